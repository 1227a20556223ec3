"""Hugging Face <-> Megatron weights for the Llama-family ``GPTModel`` of
:mod:`rlcore_megatron.model`.

Megatron fuses what HF keeps apart, and splits it over tensor-parallel (TP) ranks:

- ``linear_qkv`` holds, per query group, that group's query heads, then its key head, then its
  value head; TP ranks hold contiguous runs of groups.
- ``linear_fc1`` holds, on each TP rank, that rank's slice of ``gate_proj`` followed by its slice
  of ``up_proj`` (so the unsharded tensor is *not* simply ``cat(gate, up)`` when TP > 1).
- embeddings and the output layer are split over the (padded) vocabulary, ``linear_proj`` and
  ``linear_fc2`` over their input dimension; norms and the critic's value head are replicated.

Import reads ``model.safetensors`` (or a sharded ``model.safetensors.index.json``) written by
``save_pretrained``; export gathers the TP shards and yields full tensors under HF names.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Set
from pathlib import Path
from typing import Any, Literal, Protocol, final, runtime_checkable

import attrs
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file

from rlcore.errors import CheckpointError
from rlcore.protocols import NamedTensors
from rlcore.specs import Role
from rlcore_megatron.model import LlamaArch

__all__ = [
    "HFReader",
    "export_hf_weights",
    "load_hf_tensors",
    "load_hf_weights",
    "load_named_tensors",
    "param_map",
    "save_hf",
]

Kind = Literal["vocab", "column", "row", "replicated", "qkv", "fc1"]


@final
@attrs.frozen
class ParamMapping:
    """One Megatron parameter, the HF tensors it is made of, and how it is split over TP."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind


def param_map(arch: LlamaArch, role: Role) -> list[ParamMapping]:
    """Every parameter of the model for ``role``, in Megatron's order."""
    out = [
        ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
    ]
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out += [
            ParamMapping(
                m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated"
            ),
            ParamMapping(
                m + "self_attention.linear_qkv.weight",
                tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
                "qkv",
            ),
            ParamMapping(
                m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row"
            ),
            ParamMapping(
                m + "pre_mlp_layernorm.weight",
                (h + "post_attention_layernorm.weight",),
                "replicated",
            ),
            ParamMapping(
                m + "mlp.linear_fc1.weight",
                (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                "fc1",
            ),
            ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
        ]
    out.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if role == "critic":
        out.append(ParamMapping("output_layer.weight", ("score.weight",), "replicated"))
    elif not arch.tie_word_embeddings:
        out.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: LlamaArch) -> torch.Tensor:
    groups, hd = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // groups
    cols = q.shape[-1]
    return torch.cat(
        [
            q.reshape(groups, per * hd, cols),
            k.reshape(groups, hd, cols),
            v.reshape(groups, hd, cols),
        ],
        dim=1,
    ).reshape(-1, cols)


def _split_qkv(qkv: torch.Tensor, arch: LlamaArch) -> tuple[torch.Tensor, ...]:
    groups, hd = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // groups
    cols = qkv.shape[-1]
    q, k, v = torch.split(qkv.reshape(groups, (per + 2) * hd, cols), [per * hd, hd, hd], dim=1)
    return q.reshape(-1, cols), k.reshape(-1, cols), v.reshape(-1, cols)


def _local_shard(
    entry: ParamMapping, tensors: list[torch.Tensor], arch: LlamaArch, rank: int, size: int
) -> torch.Tensor:
    """This TP rank's slice of the Megatron parameter made from the full HF ``tensors``."""
    if entry.kind == "replicated":
        return tensors[0]
    if entry.kind == "row":
        return tensors[0].chunk(size, dim=1)[rank]
    if entry.kind == "column":
        return tensors[0].chunk(size, dim=0)[rank]
    if entry.kind == "qkv":
        q, k, v = tensors
        return _fuse_qkv(q, k, v, arch).chunk(size, dim=0)[rank]
    if entry.kind == "fc1":
        gate, up = (t.chunk(size, dim=0)[rank] for t in tensors)
        return torch.cat([gate, up], dim=0)
    # vocab: pad rows up to the padded vocabulary, then split
    full = tensors[0]
    padded = arch.padded_vocab_size(size)
    if padded != full.shape[0]:
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], full.shape[1])])
    return full.chunk(size, dim=0)[rank]


def _full_tensors(
    entry: ParamMapping, shards: list[torch.Tensor], arch: LlamaArch
) -> list[torch.Tensor]:
    """Inverse of :func:`_local_shard`: the HF tensors from every TP rank's shard."""
    if entry.kind == "replicated":
        return [shards[0]]
    if entry.kind == "row":
        return [shards[0] if len(shards) == 1 else torch.cat(shards, dim=1)]
    full = shards[0] if len(shards) == 1 else None
    if entry.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        if len(shards) == 1:
            return list(halves[0])
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if full is None:
        full = torch.cat(shards, dim=0)
    if entry.kind == "qkv":
        return list(_split_qkv(full, arch))
    if entry.kind == "vocab":
        return [full[: arch.vocab_size]]
    return [full]


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
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"cannot read tensor {name!r} from {self._files[name]}: {exc}"
            ) from exc


def _tp() -> tuple[int, int]:
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


@torch.no_grad()
def load_hf_tensors(
    model: torch.nn.Module,
    get: Callable[[str], torch.Tensor],
    names: Set[str],
    arch: LlamaArch,
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
    rank, size = _tp()
    for entry in param_map(arch, role):
        if role == "critic" and entry.hf == ("score.weight",) and "score.weight" not in names:
            continue
        missing = [n for n in entry.hf if n not in names]
        if missing:
            raise CheckpointError(
                f"{source} has no tensor {missing[0]!r} (needed for {entry.megatron})"
            )
        shard = _local_shard(entry, [get(n) for n in entry.hf], arch, rank, size)
        param = params[entry.megatron]
        if shard.shape != param.shape:
            raise CheckpointError(
                f"{source}: {'+'.join(entry.hf)} gives shape {tuple(shard.shape)} for "
                f"{entry.megatron}, expected {tuple(param.shape)} "
                "(does config.json match the weights?)"
            )
        param.copy_(shard)


def load_hf_weights(model: torch.nn.Module, folder: Path, arch: LlamaArch, role: Role) -> None:
    """Copy the HF checkpoint in ``folder`` (``save_pretrained`` safetensors) into ``model``."""
    reader = HFReader(folder)
    load_hf_tensors(model, reader.get, reader.names(), arch, role, str(folder))


def load_named_tensors(
    model: torch.nn.Module, named: NamedTensors, arch: LlamaArch, role: Role
) -> None:
    """Copy ``(hf_name, tensor)`` pairs (e.g. another stack's ``export_weights()``) into
    ``model``."""
    tensors = dict(named)
    load_hf_tensors(model, tensors.__getitem__, set(tensors), arch, role, "the given weights")


def _gather(local: torch.Tensor, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [local]
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(
        shards, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return shards


@torch.no_grad()
def export_hf_weights(
    model: torch.nn.Module, arch: LlamaArch, role: Role
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights under HF names, gathered over TP (every TP rank must iterate this).

    With TP = 1 the tensors are views of the live parameters (no copy): copy them if you keep them
    past the next ``train_step``.
    """
    params = dict(model.named_parameters())
    _, size = _tp()
    for entry in param_map(arch, role):
        full = _full_tensors(entry, _gather(params[entry.megatron].detach(), size), arch)
        yield from zip(entry.hf, full, strict=True)


def _hf_config_for_save(hf_config: Mapping[str, Any] | LlamaArch) -> dict[str, Any]:
    cfg = dict(hf_config.hf_config if isinstance(hf_config, LlamaArch) else hf_config)
    cfg.setdefault("architectures", ["LlamaForCausalLM"])
    cfg.setdefault("model_type", "llama")
    return cfg


@runtime_checkable
class _Exporting(Protocol):
    """A stack whose weights are in this process (the Megatron stacks)."""

    def export_weights(self) -> NamedTensors: ...


def save_hf(
    source: _Exporting | NamedTensors, folder: Path, hf_config: Mapping[str, Any] | LlamaArch
) -> Path:
    """Write ``model.safetensors`` and ``config.json`` into ``folder`` so that
    ``transformers.LlamaForCausalLM.from_pretrained(folder)`` loads them. Returns ``folder``.

    ``source`` is a Megatron stack (its ``export_weights()``) or ``(hf_name, tensor)`` pairs. With
    several ranks, call it on every rank (the export gathers over tensor parallel); only rank 0
    writes.
    """
    pairs: Iterable[tuple[str, torch.Tensor]] = (
        source.export_weights() if isinstance(source, _Exporting) else source
    )
    tensors = {name: t.detach().to("cpu", torch.float32).clone().contiguous() for name, t in pairs}
    folder = Path(folder)
    if dist.is_initialized() and dist.get_rank() != 0:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = _hf_config_for_save(hf_config)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return folder
