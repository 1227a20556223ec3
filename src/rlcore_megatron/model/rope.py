"""RoPE as Megatron's unfused path applies it, without two costs of that path (issue #38).

megatron-core 0.16's ``apply_rotary_pos_emb`` (``rope_utils._apply_rotary_pos_emb_bshd``, what
every layer runs without Transformer Engine's fused kernel, on GPUs as on the CPU) computes
``cos`` and ``sin`` of the frequencies again for the queries and for the keys of every layer, and
ends with ``torch.cat((t, t_pass), -1)``, which copies the whole rotated tensor even when the
rotary dimension is the head's and ``t_pass`` is empty (every model here: ``rotary_percent`` 1).

:func:`apply_rotary_pos_emb` is that path with the same arithmetic in the same order (``t * cos
+ rotate_half(t) * sin`` with Megatron's own ``_rotate_half``), so its values and gradients are
the same bits; it keeps the last frequencies' ``cos`` and ``sin`` (the frequencies tensor is
the same object in every layer of a forward, and in every forward of a length: Megatron's
``RotaryEmbedding.forward`` caches it), and skips the copy when nothing passes through
unrotated. The result is made contiguous, as the copy made it. Everything else (packed THD
sequences, the fused kernel, multi-latent attention, a partial rotary dimension) goes to
Megatron's function unchanged.

:func:`install` puts it in place of the name that Megatron's attention module calls (the one
place it is replaced; idempotent); :func:`rlcore_megatron.model.gpt.build_gpt` installs it.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

import torch

__all__ = ["apply_rotary_pos_emb", "install", "installed"]

_ATTENTION: Final = "megatron.core.transformer.attention"
_ROPE_UTILS: Final = "megatron.core.models.common.embeddings.rope_utils"

_rope_utils = importlib.import_module(_ROPE_UTILS)
_megatron_apply: Final = _rope_utils.apply_rotary_pos_emb
_rotate_half: Final = _rope_utils._rotate_half

_last: tuple[torch.Tensor, float, torch.dtype, bool, torch.Tensor, torch.Tensor] | None = None
"""The last ``(freqs, mscale, dtype, inference mode, cos, sin)``: a strong reference to
``freqs``, so that the identity check cannot match a new tensor at a freed one's address (and
tensors made under ``torch.inference_mode`` are not reused outside it, where autograd refuses
them)."""


def _cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``cos`` and ``sin`` of ``freqs`` as Megatron computes them, from the last call's when the
    frequencies are the same tensor."""
    global _last
    inference = torch.is_inference_mode_enabled()
    last = _last
    if last is not None and last[0] is freqs and last[1:4] == (mscale, dtype, inference):
        return last[4], last[5]
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    _last = (freqs, mscale, dtype, inference, cos, sin)
    return cos, sin


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    """Megatron's ``apply_rotary_pos_emb``, with its signature (module docstring)."""
    if (
        cu_seqlens is not None
        or config.apply_rope_fusion
        or config.multi_latent_attention
        or t.shape[-1] != freqs.shape[-1]
        or freqs.requires_grad
    ):
        return _megatron_apply(t, freqs, config, cu_seqlens, mscale, cp_group)  # type: ignore[no-any-return]  # Megatron is untyped
    cos, sin = _cos_sin(freqs, mscale, t.dtype)
    rotated: torch.Tensor = (t * cos) + (_rotate_half(t, config.rotary_interleaved) * sin)
    return rotated.contiguous()


def install() -> None:
    """Make Megatron's attention layers call :func:`apply_rotary_pos_emb`. Idempotent."""
    attention = importlib.import_module(_ATTENTION)
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[attr-defined]  # unstubbed module's global, on purpose


def installed() -> bool:
    """Whether Megatron's attention layers call :func:`apply_rotary_pos_emb`."""
    return getattr(importlib.import_module(_ATTENTION), "apply_rotary_pos_emb", None) is (
        apply_rotary_pos_emb
    )
