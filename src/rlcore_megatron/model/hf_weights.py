"""Hugging Face <-> Megatron weights for the ``GPTModel`` of :mod:`rlcore_megatron.model.gpt`.

Import reads ``model.safetensors`` (or a sharded ``model.safetensors.index.json``) written by
``save_pretrained``; export gathers the tensor- and expert-parallel shards and yields full tensors
under the HF names of published checkpoints. :mod:`rlcore_megatron.model.weight_map` says which HF
tensors make each Megatron parameter and how they are split.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from pathlib import Path
from typing import Any, Protocol, final, runtime_checkable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from rlcore.engines.shared_tensors import ExportBuffers
from rlcore.errors import CheckpointError
from rlcore.loop.preflight import safetensors_problem
from rlcore.specs import Role
from rlcore.weights import NamedTensors
from rlcore_megatron.model.arch import ModelArch, arch_from_hf_config
from rlcore_megatron.model.weight_map import (
    EXPERT_KINDS,
    full_tensors,
    local_shard,
    param_map,
    reshape,
    row_blocks,
)

__all__ = [
    "HFReader",
    "export_hf_weights",
    "hf_config_for_save",
    "load_hf_tensors",
    "load_hf_weights",
    "load_named_tensors",
    "save_hf",
]


@final
class HFReader:
    """Lazy access to the tensors of an HF checkpoint folder (single or sharded safetensors)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        single = self.folder / "model.safetensors"
        try:
            if index.is_file():
                weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
                self._files = {name: self.folder / file for name, file in weight_map.items()}
            elif single.is_file():
                incomplete = safetensors_problem(single)  # safetensors' own error is cryptic
                if incomplete is not None:
                    raise CheckpointError(f"cannot read HF weights: {incomplete}")
                with safe_open(str(single), framework="pt") as f:
                    self._files = {name: single for name in f.keys()}
            else:
                raise CheckpointError(
                    f"no model.safetensors or model.safetensors.index.json in {self.folder} "
                    "(save the HF model with save_pretrained(..., safe_serialization=True))"
                )
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot read HF weights in {self.folder}: {exc}") from exc

    def names(self) -> set[str]:
        return set(self._files)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise CheckpointError(f"HF checkpoint {self.folder} has no tensor {name!r}")
        try:
            with safe_open(str(self._files[name]), framework="pt") as f:
                tensor: torch.Tensor = f.get_tensor(name)
                return tensor
        except (OSError, ValueError, SafetensorError) as exc:
            why = safetensors_problem(self._files[name]) or exc  # "incomplete" says more
            raise CheckpointError(
                f"cannot read tensor {name!r} from {self._files[name]}: {why}"
            ) from exc


def _tp() -> tuple[int, int]:
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def _ep() -> tuple[int, int]:
    return (
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_world_size(),
    )


def _etp() -> tuple[int, int]:
    return (
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )


@torch.no_grad()
def load_hf_tensors(
    model: torch.nn.Module,
    get: Callable[[str], torch.Tensor],
    names: Set[str],
    arch: ModelArch,
    role: Role,
    source: str,
) -> None:
    """Copy full HF tensors (``get(name)``, ``names`` available) into this rank's shards of
    ``model``.

    A critic takes the backbone and, when the source has one (a reward model), ``score.weight``;
    otherwise its value head keeps its seeded initialisation. ``source`` names where the tensors
    come from in error messages.
    """
    params = dict(model.named_parameters())
    tp, etp = _tp(), _etp()
    entries = param_map(arch, role, *_ep())
    unmapped = sorted(set(params) - {entry.megatron for entry in entries})
    if unmapped:  # a model the weight map does not describe would keep random weights
        raise CheckpointError(
            f"{source}: no HF tensor maps to the Megatron parameters {unmapped[:5]} of this "
            f"{arch.family} model (the weight map is incomplete: please report this)"
        )
    for entry in entries:
        if role == "critic" and entry.hf == ("score.weight",) and "score.weight" not in names:
            continue
        missing = [n for n in entry.hf if n not in names]
        if missing:
            raise CheckpointError(
                f"{source} has no tensor {missing[0]!r} (needed for {entry.megatron})"
            )
        rank, size = etp if entry.kind in EXPERT_KINDS else tp
        shard = local_shard(entry, [get(n) for n in entry.hf], arch, rank, size)
        param = params[entry.megatron]
        if shard.shape != param.shape:
            raise CheckpointError(
                f"{source}: {'+'.join(entry.hf)} gives shape {tuple(shard.shape)} for "
                f"{entry.megatron}, expected {tuple(param.shape)} "
                "(does config.json match the weights?)"
            )
        param.copy_(shard)


def load_hf_weights(model: torch.nn.Module, folder: Path, arch: ModelArch, role: Role) -> None:
    """Copy the HF checkpoint in ``folder`` (``save_pretrained`` safetensors) into ``model``."""
    reader = HFReader(folder)
    load_hf_tensors(model, reader.get, reader.names(), arch, role, str(folder))


def load_named_tensors(
    model: torch.nn.Module, named: NamedTensors, arch: ModelArch, role: Role
) -> None:
    """Copy ``(hf_name, tensor)`` pairs (e.g. another stack's ``export_weights()``) into
    ``model``."""
    tensors = dict(named)
    load_hf_tensors(model, tensors.__getitem__, set(tensors), arch, role, "the given weights")


def _gather(local: torch.Tensor, group: dist.ProcessGroup, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


@torch.no_grad()
def export_hf_weights(
    model: torch.nn.Module,
    arch: ModelArch,
    role: Role,
    buffers: ExportBuffers | None = None,
    *,
    blocks: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights under HF names, gathered over TP and EP (every rank must iterate this).

    With one rank the tensors are views of the live parameters (no copy): copy them if you keep
    them past the next ``train_step``. The others are fresh tensors, or with ``buffers`` (a
    stack's, for its weight sinks), that object's buffers, rewritten by the next export. With
    ``blocks`` (for sinks that take row blocks: :attr:`rlcore.weights.Takes.row_blocks`), q, k and
    v are row-block views of the fused QKV, so with one rank every tensor is a live view.
    """
    materialise = row_blocks if blocks else reshape if buffers is None else buffers.materialise
    params = dict(model.named_parameters())
    _, tp_size = _tp()
    _, etp_size = _etp()
    ep_rank, ep_size = _ep()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    etp_group = parallel_state.get_expert_tensor_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    # Every EP rank's map has the same Megatron names in the same order; entry i of rank r
    # names the HF experts that rank r holds there.
    maps = [param_map(arch, role, r, ep_size) for r in range(ep_size)]
    for i, entry in enumerate(maps[ep_rank]):
        local = params[entry.megatron].detach()
        if entry.kind not in EXPERT_KINDS:
            full = full_tensors(entry, _gather(local, tp_group, tp_size), arch, materialise)
            yield from zip(entry.hf, full, strict=True)
            continue
        # this EP rank's expert, whole; then every EP rank's
        mine = full_tensors(entry, _gather(local, etp_group, etp_size), arch, materialise)
        for k, tensor in enumerate(mine):
            for r, full_tensor in enumerate(_gather(tensor, ep_group, ep_size)):
                yield maps[r][i].hf[k], full_tensor


def hf_config_for_save(
    hf_config: Mapping[str, Any] | ModelArch, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """The ``config.json`` of an exported model: the source config, with the transformers class
    of its family as ``architectures`` and, when given, the dtype the weights are stored in."""
    arch = hf_config if isinstance(hf_config, ModelArch) else arch_from_hf_config(hf_config)
    cfg = dict(arch.hf_config)
    cfg["model_type"] = arch.family
    cfg["architectures"] = [arch.architecture]
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        cfg["dtype"] = name
        if "torch_dtype" in cfg:  # the Hub's older name for it
            cfg["torch_dtype"] = name
    return cfg


@runtime_checkable
class _Exporting(Protocol):
    """A stack whose weights are in this process (the Megatron stacks)."""

    def export_weights(self) -> NamedTensors: ...


def save_hf(
    source: _Exporting | NamedTensors, folder: Path, hf_config: Mapping[str, Any] | ModelArch
) -> Path:
    """Write ``model.safetensors`` and ``config.json`` into ``folder`` so that
    ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` and the rollout engines load
    them. Returns ``folder``.

    ``source`` is a Megatron stack (its ``export_weights()``) or ``(hf_name, tensor)`` pairs,
    saved in their own dtype. With several ranks, call it on every rank (the export gathers over
    tensor and expert parallel); only rank 0 writes.
    """
    pairs: Iterable[tuple[str, torch.Tensor]] = (
        source.export_weights() if isinstance(source, _Exporting) else source
    )
    tensors = {name: t.detach().to("cpu").clone().contiguous() for name, t in pairs}
    folder = Path(folder)
    if dist.is_initialized() and dist.get_rank() != 0:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    dtypes = {t.dtype for t in tensors.values()}
    config = hf_config_for_save(hf_config, dtypes.pop() if len(dtypes) == 1 else None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder
