"""Which HF tensors make each Megatron parameter, and how they are split over ranks.

Megatron fuses what HF keeps apart, and splits it over tensor-parallel (TP) and expert-parallel
(EP) ranks:

- ``linear_qkv`` (weight and, for Qwen2, bias) holds, per query group, that group's query heads,
  then its key head, then its value head; TP ranks hold contiguous runs of groups.
- ``linear_fc1`` holds, on each TP rank, that rank's slice of ``gate_proj`` followed by its slice
  of ``up_proj`` (so the unsharded tensor is *not* simply ``cat(gate, up)`` when TP > 1).
- embeddings and the output layer are split over the (padded) vocabulary, ``linear_proj`` and
  ``linear_fc2`` over their input dimension; norms (QK-norms included), the MoE router and the
  critic's value head are replicated.
- Experts: EP rank ``r`` of ``E`` holds experts ``r * n .. (r + 1) * n - 1``
  (``n = num_experts / E``) as its local experts ``0 .. n - 1``, each split over the expert
  tensor-parallel ranks (the TP ranks) like a dense MLP's ``linear_fc1`` and ``linear_fc2``.

The HF names are the published checkpoints' (per-expert ``mlp.experts.{e}.gate_proj.weight``,
which transformers 5 fuses on load and splits again on ``save_pretrained``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal, final

import attrs
import torch

from rlcore.specs import Role
from rlcore_megatron.model.arch import ModelArch

__all__ = [
    "EXPERT_KINDS",
    "Kind",
    "Materialise",
    "ParamMapping",
    "full_tensors",
    "local_shard",
    "param_map",
    "reshape",
    "row_blocks",
]

Kind = Literal["vocab", "row", "replicated", "qkv", "fc1", "expert_fc1", "expert_row"]
EXPERT_KINDS: Final = frozenset({"expert_fc1", "expert_row"})
"""Kinds held by one expert-parallel rank each, split over the expert tensor-parallel ranks
like ``fc1`` and ``row``."""


@final
@attrs.frozen
class ParamMapping:
    """One Megatron parameter, the HF tensors it is made of, and how it is split over ranks."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind


def _attention(arch: ModelArch, m: str, h: str) -> list[ParamMapping]:
    qkv = [
        ParamMapping(
            m + "self_attention.linear_qkv.weight",
            tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"),
            "qkv",
        )
    ]
    if arch.qkv_bias:
        qkv.append(
            ParamMapping(
                m + "self_attention.linear_qkv.bias",
                tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"),
                "qkv",
            )
        )
    if arch.qk_norm:
        qkv += [
            ParamMapping(
                m + f"self_attention.{p}_layernorm.weight",
                (h + f"self_attn.{p}_norm.weight",),
                "replicated",
            )
            for p in "qk"
        ]
    return [
        ParamMapping(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated"),
        *qkv,
        ParamMapping(
            m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row"
        ),
        ParamMapping(
            m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated"
        ),
    ]


def _mlp(
    arch: ModelArch, layer: int, m: str, h: str, ep_rank: int, ep_size: int
) -> list[ParamMapping]:
    moe = arch.moe
    if moe is None or not moe.moe_layers[layer]:
        return [
            ParamMapping(
                m + "mlp.linear_fc1.weight",
                (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                "fc1",
            ),
            ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
        ]
    out = [ParamMapping(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated")]
    per_rank = moe.num_experts // ep_size
    for local in range(per_rank):
        e = f"{h}mlp.experts.{ep_rank * per_rank + local}."
        x = f"{m}mlp.experts.local_experts.{local}."
        out += [
            ParamMapping(
                x + "linear_fc1.weight",
                (e + "gate_proj.weight", e + "up_proj.weight"),
                "expert_fc1",
            ),
            ParamMapping(x + "linear_fc2.weight", (e + "down_proj.weight",), "expert_row"),
        ]
    return out


def param_map(
    arch: ModelArch, role: Role, ep_rank: int = 0, ep_size: int = 1
) -> list[ParamMapping]:
    """Every parameter of the model for ``role`` on expert-parallel rank ``ep_rank`` of
    ``ep_size``, in Megatron's order (the same length and Megatron names on every EP rank)."""
    out = [
        ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
    ]
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out += _attention(arch, m, h)
        out += _mlp(arch, i, m, h, ep_rank, ep_size)
    out.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if role == "critic":
        out.append(ParamMapping("output_layer.weight", ("score.weight",), "replicated"))
    elif not arch.tie_word_embeddings:
        out.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    """``[q; k; v]`` rows regrouped per query group: ``[groups * (per + 2) * head_dim, cols]``
    (a bias is a single column)."""
    groups, hd = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // groups
    cols = q.shape[1] if q.dim() == 2 else 1
    fused = torch.cat(
        [
            q.reshape(groups, per * hd, cols),
            k.reshape(groups, hd, cols),
            v.reshape(groups, hd, cols),
        ],
        dim=1,
    ).reshape(-1, cols)
    return fused if q.dim() == 2 else fused.reshape(-1)


Materialise = Callable[[str, torch.Tensor, tuple[int, ...]], torch.Tensor]
"""``(hf_name, view, shape)``: a tensor of ``shape`` holding ``view``'s elements in order, for a
tensor the export has to lay out anew (q, k and v out of a fused QKV, whose rows interleave)."""


def reshape(name: str, view: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The default :data:`Materialise`: ``view.reshape(shape)`` (a fresh tensor)."""
    return view.reshape(shape)


def row_blocks(name: str, view: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The :data:`Materialise` for sinks that take row blocks
    (:attr:`rlcore.weights.Takes.row_blocks`): ``view`` itself, no copy, as ``[blocks, rows,
    *shape[1:]]`` (q, k or v rows of each query group of a fused QKV)."""
    return view.view(view.shape[0], view.shape[1], *shape[1:])


def _split_qkv(
    qkv: torch.Tensor, arch: ModelArch, names: tuple[str, ...], materialise: Materialise
) -> list[torch.Tensor]:
    groups, hd = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // groups
    cols = qkv.shape[1] if qkv.dim() == 2 else 1
    parts = torch.split(qkv.reshape(groups, (per + 2) * hd, cols), [per * hd, hd, hd], dim=1)
    out = []
    for name, part in zip(names, parts, strict=True):
        rows = groups * part.shape[1]
        out.append(materialise(name, part, (rows, cols) if qkv.dim() == 2 else (rows,)))
    return out


def local_shard(
    entry: ParamMapping, tensors: list[torch.Tensor], arch: ModelArch, rank: int, size: int
) -> torch.Tensor:
    """This rank's slice of the Megatron parameter made from the full HF ``tensors``; ``rank``
    and ``size`` are the tensor-parallel ones (the expert tensor-parallel ones for experts)."""
    if entry.kind == "replicated":
        return tensors[0]
    if entry.kind in ("row", "expert_row"):
        return tensors[0].chunk(size, dim=1)[rank]
    if entry.kind == "qkv":
        q, k, v = tensors
        return _fuse_qkv(q, k, v, arch).chunk(size, dim=0)[rank]
    if entry.kind in ("fc1", "expert_fc1"):
        gate, up = (t.chunk(size, dim=0)[rank] for t in tensors)
        return torch.cat([gate, up], dim=0)
    # vocab: pad rows up to the padded vocabulary, then split
    full = tensors[0]
    padded = arch.padded_vocab_size(size)
    if padded != full.shape[0]:
        full = torch.cat([full, full.new_zeros(padded - full.shape[0], full.shape[1])])
    return full.chunk(size, dim=0)[rank]


def full_tensors(
    entry: ParamMapping,
    shards: list[torch.Tensor],
    arch: ModelArch,
    materialise: Materialise = reshape,
) -> list[torch.Tensor]:
    """Inverse of :func:`local_shard`: the HF tensors from every (expert) tensor-parallel rank's
    shard, in rank order. Views of the shards where the layout allows; ``materialise`` makes the
    others (default: fresh tensors)."""
    if entry.kind == "replicated":
        return [shards[0]]
    if entry.kind in ("row", "expert_row"):
        return [shards[0] if len(shards) == 1 else torch.cat(shards, dim=1)]
    if entry.kind in ("fc1", "expert_fc1"):
        halves = [s.chunk(2, dim=0) for s in shards]
        if len(shards) == 1:
            return list(halves[0])
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    full = shards[0] if len(shards) == 1 else torch.cat(shards, dim=0)
    if entry.kind == "qkv":
        return _split_qkv(full, arch, entry.hf, materialise)
    return [full[: arch.vocab_size]]  # vocab
