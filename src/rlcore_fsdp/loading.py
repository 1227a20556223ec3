"""Loading a Hugging Face folder's weights straight into FSDP2's shards (issue #36).

``from_pretrained`` followed by ``fully_shard`` holds the weights twice for a moment (the full
model in anonymous memory, and the safetensors pages it mapped), which sets an eval stack's peak.
Here instead:

1. :func:`empty_model` builds the model with its parameters on the meta device (no memory; its
   buffers, such as the rotary ``inv_freq``, computed as usual) and maps each parameter to its
   checkpoint tensor; a parameter the checkpoint lacks by design (a critic's value head) gets
   transformers' own initialization, as ``from_pretrained`` gives it, with the same draws;
2. the caller adds LoRA adapters (:func:`materialize_adapters` gives them peft's initialization,
   the draws peft made) and shards the model (``fully_shard``);
3. :func:`fill` allocates the shards (``to_empty``) and reads each rank's rows of each tensor
   from the files with plain reads (no mapping, so no page-cache pages in this process), the
   tensors the build made (buffers, a new head, adapters) kept as they were.

A folder whose tensor names do not map onto the model's one for one (transformers renames or
converts them on load, or the model lacks a tensor the checkpoint should hold) is loaded with
``from_pretrained`` instead, for the reason :func:`empty_model` returns.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["Checkpoint", "empty_model", "fill", "materialize_adapters", "plain"]

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# what FSDP wrappers and peft put into parameter names that the checkpoint's names lack
_WRAPPERS = re.compile(r"\._checkpoint_wrapped_module(?=\.)|\.base_layer(?=\.)")


@dataclass(frozen=True)
class _Entry:
    """One tensor of a safetensors file: where its bytes start, its dtype and shape."""

    file: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def read_rows(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of the tensor (its first dimension; a scalar whole), read into
        ``out`` (contiguous, on the CPU, of this dtype) or a new tensor."""
        rows = (stop - start,) + self.shape[1:] if self.shape else ()
        if out is None:
            out = torch.empty(rows, dtype=self.dtype)
        row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize
        target = out.reshape(-1).view(torch.uint8).numpy().data  # the bytes of out itself
        with self.file.open("rb", buffering=0) as f:
            f.seek(self.offset + start * row_bytes)
            done = 0
            while done < len(target):
                n = f.readinto(target[done:])
                if not n:
                    raise OSError(f"{self.file} ends inside its tensor data")
                done += n
        return out


def _header(file: Path) -> dict[str, Any]:
    with file.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header: dict[str, Any] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: (info, 8 + size) for name, info in header.items()}


def _entries(folder: Path) -> dict[str, _Entry] | str:
    """The folder's tensors by name (``model.safetensors``, or the files its
    ``model.safetensors.index.json`` lists), or why they cannot be read here."""
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    elif index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        return f"{folder} holds no model.safetensors (nor its index)"
    entries = {}
    for file in files:
        for name, (info, data_start) in _header(file).items():
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                return f"{file}: tensor {name} has dtype {info['dtype']}"
            begin = info["data_offsets"][0]
            entries[name] = _Entry(file, data_start + begin, dtype, tuple(info["shape"]))
    return entries


@dataclass(frozen=True)
class Checkpoint:
    """Where each parameter and persistent buffer of the model (by its name, wrappers left out)
    is in the folder."""

    sources: dict[str, _Entry]


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter registered in the block lives on the meta device (buffers do not), as
    accelerate's ``init_empty_weights(include_buffers=False)``: a module's own initialization
    of its parameters then draws nothing and allocates nothing."""
    register = torch.nn.Module.register_parameter

    def on_meta(self: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and not param.is_meta:
            self._parameters[name] = torch.nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]  # the block only
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _conversions(model: Any) -> bool:
    """Whether transformers renames or converts this model's checkpoint tensors on load."""
    if getattr(model, "_checkpoint_conversion_mapping", None):
        return True
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # transformers 4: the attribute above is its only mapping
        return False
    return bool(get_model_conversion_mapping(model, add_legacy=False))


def empty_model(
    folder: Path, config: Any, critic: bool, remote: bool
) -> tuple[Any, Checkpoint] | str:
    """The model of ``config`` (a critic: the one-label token classifier) with its checkpoint
    parameters on the meta device, its buffers and the parameters the checkpoint lacks by design
    (a critic's head) real and initialized as ``from_pretrained`` would; with where each meta
    tensor is in ``folder``. A string instead: why this folder must go through
    ``from_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    entries = _entries(folder)
    if isinstance(entries, str):
        return entries
    auto = AutoModelForTokenClassification if critic else AutoModelForCausalLM
    with _parameters_on_meta():
        # transformers leaves from_config unannotated
        model = auto.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32, trust_remote_code=remote
        )
    if _conversions(model):
        return f"transformers converts {type(model).__name__}'s checkpoint tensors on load"
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    sources: dict[str, _Entry] = {}
    new: list[tuple[torch.nn.Module, str]] = []
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied to one met before (GPT-2's head is its embedding)
            continue
        seen.add(id(tensor))
        names = (name, name.removeprefix(prefix), prefix + name) if prefix else (name,)
        found = next((entries[n] for n in names if n in entries), None)
        if found is not None and found.shape == tuple(tensor.shape):
            sources[name] = found
            tensor._is_hf_initialized = True  # transformers' flag: loaded, not to initialize
        elif critic and prefix and not name.startswith(prefix) and tensor.is_meta:
            owner, _, leaf = name.rpartition(".")
            new.append((model.get_submodule(owner), leaf))
        else:
            return f"the checkpoint has no tensor {name} of shape {tuple(tensor.shape)}"
    for module, leaf in new:
        meta = module._parameters[leaf]
        assert meta is not None
        module._parameters[leaf] = torch.nn.Parameter(
            torch.empty_like(meta, device="cpu"), requires_grad=meta.requires_grad
        )
        # from_config's pass over the meta weights flagged the module as initialized
        vars(module).pop("_is_hf_initialized", None)
    if new:
        # from_pretrained's initialization of what it did not load, the same draws in order
        model.initialize_weights()
    return model, Checkpoint(sources)


def materialize_adapters(model: Any, rng_state: torch.Tensor) -> str | None:
    """peft left the adapters of a peft ``model`` over meta weights on the meta device: each made
    real on the CPU with peft's initialization, replayed from ``rng_state`` (the generator's
    state before ``get_peft_model``) in peft's order, so the same values it drew. ``None``, or
    (nothing changed) why an adapter is not one this replays: then go through
    ``from_pretrained``."""
    from peft.tuners.lora import LoraLayer

    from rlcore_fsdp.lora import ADAPTER, lora_config

    config = lora_config(model)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        pair = [m[ADAPTER] if ADAPTER in m else None for m in (layer.lora_A, layer.lora_B)]
        if (
            not all(type(m) is torch.nn.Linear for m in pair)
            or config.init_lora_weights is not True
        ):
            return f"peft's LoRA layer {type(layer).__name__} is not two linear adapters"
    torch.random.set_rng_state(rng_state)
    for layer in layers:
        for adapter in (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]):
            assert isinstance(adapter, torch.nn.Linear)
            adapter.to_empty(device="cpu")
            adapter.reset_parameters()  # what nn.Linear's constructor drew
        layer.reset_lora_parameters(ADAPTER, config.init_lora_weights)  # type: ignore[no-untyped-call]  # peft
    return None


def plain(name: str) -> str:
    """A parameter's name as the checkpoint has it: without what activation checkpointing's
    wrapper and peft's layers add."""
    return _WRAPPERS.sub("", name)


def _rows(tensor: DTensor) -> tuple[int, int]:
    """The rows of the full tensor that this rank's shard holds (FSDP2: ``Shard(0)`` over a
    one-dimensional mesh, ``torch.chunk``'s split)."""
    (placement,) = tensor.placements
    n = tensor.shape[0] if tensor.ndim else 1
    if isinstance(placement, Replicate):
        return 0, n
    if not isinstance(placement, Shard) or placement.dim != 0:
        raise RuntimeError(f"unexpected placement {placement} of a sharded parameter")
    mesh = tensor.device_mesh
    chunk = -(-n // mesh.size())
    start = min(chunk * mesh.get_local_rank(), n)
    return start, min(start + chunk, n)


@torch.no_grad()
def fill(
    model: torch.nn.Module,
    checkpoint: Checkpoint,
    kept: dict[str, torch.Tensor],
    device: torch.device | str,
) -> None:
    """Allocate the sharded ``model``'s parameters on ``device`` (where FSDP keeps the shards:
    the CPU when it offloads them) and fill each rank's shard: from the checkpoint, or from
    ``kept`` (the full tensors the build made, by :func:`plain` name); buffers stay as sharding
    left them, persistent ones then read from the checkpoint."""
    buffers = [
        (module, name, buffer)
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None and not buffer.is_meta
    ]
    model.to_empty(device=device)
    for module, name, buffer in buffers:
        module._buffers[name] = buffer
    for name, param in model.named_parameters():
        key = plain(name)
        assert isinstance(param, DTensor), name
        local = param.to_local()
        start, stop = _rows(param)
        if key in checkpoint.sources:
            entry = checkpoint.sources[key]
            direct = local.device.type == "cpu" and local.dtype == entry.dtype
            if direct and local.is_contiguous():
                entry.read_rows(start, stop, local)
            else:
                local.copy_(entry.read_rows(start, stop))
        elif key in kept:
            full = kept[key]
            local.copy_(full[start:stop] if full.ndim else full)
        else:
            raise RuntimeError(f"no source for the parameter {name}")
    for name, buffer in model.named_buffers():
        key = plain(name)
        if key in checkpoint.sources:  # a persistent buffer: the checkpoint's value
            entry = checkpoint.sources[key]
            buffer.copy_(entry.read_rows(0, entry.shape[0] if entry.shape else 1))
