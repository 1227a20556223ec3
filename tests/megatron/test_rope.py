"""RoPE without Megatron's per-layer ``cos``/``sin`` and copy, and the causal mask built once per
length (issue #38): the same bits as Megatron's own code, alone and in a whole train step."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlcore_megatron import stacks
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.model import rope
from tests.megatron.helpers import make_batch, make_samples, train_spec, weights

pytestmark = pytest.mark.megatron

_rope_utils = importlib.import_module("megatron.core.models.common.embeddings.rope_utils")
_attention = importlib.import_module("megatron.core.transformer.attention")


def _config(interleaved: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        apply_rope_fusion=False, multi_latent_attention=False, rotary_interleaved=interleaved
    )


def _rotated(
    apply: object, mixed: torch.Tensor, freqs: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries and keys cut from a fused QKV tensor as Megatron's attention cuts them (views),
    rotated by ``apply`` twice with the same frequencies, and the fused tensor's gradient."""
    assert callable(apply)
    mixed.grad = None
    query, key, _ = torch.split(mixed, [16, 8, 8], dim=3)
    query = query.reshape(query.shape[0], query.shape[1], -1, 8)
    config = _config(interleaved)
    q = apply(query, freqs, config, None, 1.0, None)
    k = apply(key, freqs, config, None, 1.0, None)
    torch.autograd.backward([q, k], [torch.ones_like(q) * 0.5, torch.full_like(k, 0.25)])
    assert mixed.grad is not None
    return q, k, mixed.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_gives_megatrons_bits(
    megatron_rank: None, dtype: torch.dtype, interleaved: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    mixed = torch.randn(5, 3, 2, 32, generator=gen).to(dtype).requires_grad_()
    freqs = torch.randn(5, 1, 1, 8, generator=gen)
    theirs = _rotated(_rope_utils.apply_rotary_pos_emb, mixed, freqs, interleaved)
    for _ in range(2):  # the second time from the kept cos/sin
        ours = _rotated(rope.apply_rotary_pos_emb, mixed, freqs, interleaved)
        for got, expected in zip(ours, theirs, strict=True):
            assert got.dtype == expected.dtype
            assert got.is_contiguous()
            assert torch.equal(got, expected)


def test_rope_recomputes_cos_sin_for_other_frequencies(megatron_rank: None) -> None:
    t = torch.randn(4, 2, 1, 8)
    first, second = torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 8)
    for freqs in (first, second, first):
        got = rope.apply_rotary_pos_emb(t, freqs, _config())
        assert torch.equal(got, _rope_utils.apply_rotary_pos_emb(t, freqs, _config(), None, 1.0, 0))


def test_partial_rotary_goes_to_megatron(megatron_rank: None) -> None:
    t = torch.randn(4, 2, 1, 8)
    freqs = torch.randn(4, 1, 1, 4)  # half the head rotated: Megatron's path, unrotated part kept
    got = rope.apply_rotary_pos_emb(t, freqs, _config())
    assert torch.equal(got[..., 4:], t[..., 4:])
    assert torch.equal(got, _rope_utils.apply_rotary_pos_emb(t, freqs, _config(), None, 1.0, 0))


def test_causal_mask_is_megatrons(megatron_rank: None) -> None:
    megatron_mask = importlib.import_module("megatron.core.transformer.utils")
    for seq in (1, 2, 7):
        mask = stacks.causal_mask(seq, torch.device("cpu"))
        assert torch.equal(mask, megatron_mask.get_default_causal_mask(seq))
        assert stacks.causal_mask(seq, torch.device("cpu")) is mask  # built once


def _step(hf: Path) -> tuple[float, float, dict[str, torch.Tensor]]:
    stack = MegatronBackend().build_training_stack(train_spec(hf))
    metrics = stack.train_step(make_batch(make_samples(4, seed=5), seed=6, old=True, ref=True))
    return metrics.loss, metrics.grad_norm, weights(stack.export_weights())


def test_a_train_step_is_the_same_bits_as_megatrons_own(
    tiny_hf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loss, grad_norm, ours = _step(tiny_hf)
    assert rope.installed()  # build_gpt put it in place
    # Megatron's RoPE, and no mask passed, so that its softmax builds the causal mask per layer.
    monkeypatch.setattr(rope, "install", lambda: None)
    monkeypatch.setattr(_attention, "apply_rotary_pos_emb", _rope_utils.apply_rotary_pos_emb)
    monkeypatch.setattr(stacks, "causal_mask", lambda seq, device: None)
    m_loss, m_grad_norm, theirs = _step(tiny_hf)
    assert grad_norm > 0
    assert (loss, grad_norm) == (m_loss, m_grad_norm)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
