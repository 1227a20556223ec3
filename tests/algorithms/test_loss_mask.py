"""Multi-turn loss masks: environment tokens count nowhere.

Every reduction over a batch whose episodes carry environment tokens must equal the same reduction
over the batch with those tokens *removed* (each row compacted to its model tokens), and must not
depend on what the per-token inputs hold at environment positions. The trainer-level version of
this (exactly zero gradient on the real Megatron stack) is in tests/megatron/test_loss_mask.py.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.algorithms.advantages import estimate_advantages, gae
from rlcore.algorithms.batching import TensorBatch, tensorize
from rlcore.algorithms.losses import actor_loss, critic_loss, loss_normalizer
from rlcore.samples import Generation, Prompt, Sample, TrainBatch
from rlcore.specs import AdvantageSpec, ISCorrection, LossAggMode, LossSpec

MODES: tuple[LossAggMode, ...] = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-budget")


@st.composite
def episode_masks(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """``(response_mask, model_mask)``, both ``BoolTensor[B, T]``: each row's response is a
    prefix of the width; inside it, model tokens and environment tokens in any order, with at
    least one model token."""
    b = draw(st.integers(1, 4))
    t = draw(st.integers(2, 7))
    rows, responses = [], []
    for _ in range(b):
        n = draw(st.integers(1, t))
        row = draw(st.lists(st.booleans(), min_size=n, max_size=n))
        row[draw(st.integers(0, n - 1))] = True
        rows.append(row + [False] * (t - n))
        responses.append([True] * n + [False] * (t - n))
    return torch.tensor(responses), torch.tensor(rows)


def compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's entries where ``mask`` is True, moved left; the rest 0 (``[B, T']``)."""
    width = int(mask.sum(dim=1).max())
    out = torch.zeros(x.shape[0], width, dtype=x.dtype)
    for i in range(x.shape[0]):
        kept = x[i][mask[i]]
        out[i, : kept.numel()] = kept
    return out


def prefix_mask(mask: torch.Tensor) -> torch.Tensor:
    counts = mask.sum(dim=1, keepdim=True)
    return torch.arange(int(counts.max())) < counts


def batch(mask: torch.Tensor, response: torch.Tensor, **fields: torch.Tensor) -> TensorBatch:
    b, t = mask.shape
    return TensorBatch(
        tokens=torch.zeros(b, t + 1, dtype=torch.long),
        attention_mask=torch.ones(b, t + 1, dtype=torch.bool),
        response_index=torch.arange(t).expand(b, t),
        response_mask=response,
        model_token_mask=mask,
        **fields,
    )


def noisy(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` with large random values wherever ``mask`` is False."""
    g = torch.Generator().manual_seed(seed)
    junk = torch.randn(x.shape, generator=g, dtype=x.dtype) * 50
    return torch.where(mask, x, junk)


@settings(max_examples=40, deadline=None)
@given(masks=episode_masks(), mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_actor_loss_ignores_environment_tokens(
    masks: tuple[torch.Tensor, torch.Tensor], mode: str, seed: int
) -> None:
    response, mask = masks
    g = torch.Generator().manual_seed(seed)
    shape = mask.shape

    def rand(scale: float = 0.3) -> torch.Tensor:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).requires_grad_(False)

    logp = rand() - 1.0
    fields = {
        "advantages": rand(1.0),
        "old_log_probs": rand() - 1.0,
        "ref_log_probs": rand() - 1.0,
        "rollout_log_probs": rand() - 1.0,
    }
    entropy = rand().abs()
    for level, ratio in (("token", "token"), ("geometric", "sequence")):
        spec = LossSpec(
            agg_mode=mode,  # type: ignore[arg-type]  # sampled from MODES
            agg_constant=5,
            entropy_coef=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            kl_loss_type="k3",
            ratio_level=ratio,  # type: ignore[arg-type]  # a RatioLevel
            correction=ISCorrection(mode="clip", level=level, low=0.5, high=1.5),  # type: ignore[arg-type]  # an ISLevel
        )
        # Full batch with junk at environment positions.
        lp_full = noisy(logp, mask, seed + 1).requires_grad_(True)
        full = batch(mask, response, **{k: noisy(v, mask, seed + 2) for k, v in fields.items()})
        out_full = actor_loss(lp_full, full, spec, noisy(entropy, mask, seed + 3))
        # The same batch with environment tokens removed.
        cm = prefix_mask(mask)
        lp_small = compact(logp, mask).requires_grad_(True)
        small = batch(cm, cm, **{k: compact(v, mask) for k, v in fields.items()})
        out_small = actor_loss(lp_small, small, spec, compact(entropy, mask))
        assert out_full.normalizer == out_small.normalizer
        assert out_full.tokens == out_small.tokens == int(mask.sum())
        torch.testing.assert_close(out_full.loss, out_small.loss)
        assert out_full.metrics.keys() == out_small.metrics.keys()
        for key, value in out_full.metrics.items():
            assert value == pytest.approx(out_small.metrics[key], rel=1e-9, abs=1e-12), key
        assert out_full.maxima == pytest.approx(out_small.maxima)
        (grad_full,) = torch.autograd.grad(out_full.loss, lp_full)
        (grad_small,) = torch.autograd.grad(out_small.loss, lp_small)
        assert torch.all(grad_full[~mask] == 0)
        torch.testing.assert_close(compact(grad_full, mask), grad_small)
        assert loss_normalizer(spec.agg_mode, full.loss_mask) == loss_normalizer(
            spec.agg_mode, small.loss_mask
        )


@settings(max_examples=30, deadline=None)
@given(masks=episode_masks(), mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_critic_loss_ignores_environment_tokens(
    masks: tuple[torch.Tensor, torch.Tensor], mode: str, seed: int
) -> None:
    response, mask = masks
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    returns = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    old = values + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    spec = LossSpec(agg_mode=mode, agg_constant=4)  # type: ignore[arg-type]  # from MODES
    v_full = noisy(values, mask, seed).requires_grad_(True)
    full = batch(
        mask,
        response,
        advantages=torch.zeros(mask.shape, dtype=torch.float64),
        returns=noisy(returns, mask, seed + 1),
        old_values=noisy(old, mask, seed + 2),
    )
    cm = prefix_mask(mask)
    v_small = compact(values, mask).requires_grad_(True)
    small = batch(
        cm,
        cm,
        advantages=torch.zeros(cm.shape, dtype=torch.float64),
        returns=compact(returns, mask),
        old_values=compact(old, mask),
    )
    out_full, out_small = critic_loss(v_full, full, spec), critic_loss(v_small, small, spec)
    torch.testing.assert_close(out_full.loss, out_small.loss)
    assert out_full.metrics == pytest.approx(out_small.metrics)
    (grad_full,) = torch.autograd.grad(out_full.loss, v_full)
    (grad_small,) = torch.autograd.grad(out_small.loss, v_small)
    assert torch.all(grad_full[~mask] == 0)
    torch.testing.assert_close(compact(grad_full, mask), grad_small)


def test_gae_skips_environment_tokens_by_hand() -> None:
    # Actions at t = 0 and t = 3; t = 1, 2 are an observation. Reward 1 on the last action.
    mask = torch.tensor([[True, False, False, True]])
    rewards = torch.tensor([[0.0, 9.0, 9.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 7.0, 7.0, 0.25]], dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lambd=0.8)
    # delta_3 = 1 - 0.25 = 0.75; A_3 = 0.75.
    # delta_0 = 0 + 0.9 * 0.25 - 0.5 = -0.275; A_0 = -0.275 + 0.9 * 0.8 * 0.75 = 0.265.
    torch.testing.assert_close(adv, torch.tensor([[0.265, 0.0, 0.0, 0.75]], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([[0.765, 0.0, 0.0, 1.0]], dtype=torch.float64))


def _episode(prompt: int, pieces: list[tuple[int, int]], reward: float, group: int) -> Sample:
    """A sample whose response is ``pieces``: (token count, is-model) runs."""
    tokens: list[int] = []
    mask: list[int] = []
    for count, is_model in pieces:
        start = len(tokens)
        tokens.extend(range(10 + start, 10 + start + count))
        mask.extend([is_model] * count)
    gen = Generation(tuple(tokens), tuple(0.0 for _ in tokens), "", "stop", loss_mask=tuple(mask))
    return Sample(Prompt(prompt, "", (1,)), gen, reward, group)


def _without_env(s: Sample) -> Sample:
    keep = [i for i, m in enumerate(s.response.model_mask) if m]
    tokens = tuple(s.response.token_ids[i] for i in keep)
    gen = Generation(tokens, tuple(0.0 for _ in keep), "", "stop")
    return attrs.evolve(s, response=gen)


@pytest.mark.parametrize(
    "spec",
    [
        AdvantageSpec("grpo", 2),
        AdvantageSpec("grpo", 2, whiten=True),
        AdvantageSpec("reinforce_plus_plus", 2, gamma=0.9),
        AdvantageSpec("reinforce_plus_plus_baseline", 2),
        AdvantageSpec("ppo", 2, gamma=0.95, lambd=0.9, whiten=True),
        AdvantageSpec("grpo", 2, kl_coef=0.1, kl_type="k3"),
        AdvantageSpec("ppo", 2, gamma=0.9, lambd=0.7, kl_coef=0.05, kl_type="k1"),
    ],
    ids=lambda s: f"{s.estimator}-w{int(s.whiten)}-kl{s.kl_coef}",
)
def test_advantages_equal_those_without_environment_tokens(spec: AdvantageSpec) -> None:
    samples = [
        _episode(0, [(2, 1), (3, 0), (2, 1)], 1.0, 0),
        _episode(0, [(1, 1), (2, 0)], 0.0, 0),  # truncated after an observation
        _episode(1, [(3, 1)], 0.5, 1),
        _episode(1, [(1, 1), (1, 0), (1, 1), (4, 0), (2, 1)], 0.25, 1),
    ]
    g = torch.Generator().manual_seed(0)

    def rows() -> tuple[tuple[float, ...], ...]:
        return tuple(
            tuple(float(x) for x in torch.randn(len(s.response.token_ids), generator=g))
            for s in samples
        )

    values, logp, ref = rows(), rows(), rows()

    def keep(rs: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(
            tuple(x for x, m in zip(r, s.response.model_mask, strict=True) if m)
            for r, s in zip(rs, samples, strict=True)
        )

    def junk(rs: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        return tuple(
            tuple(x if m else 123.0 for x, m in zip(r, s.response.model_mask, strict=True))
            for r, s in zip(rs, samples, strict=True)
        )

    kw = {"values": values} if spec.estimator == "ppo" else {}
    kl = {"log_probs": logp, "ref_log_probs": ref} if spec.kl_coef else {}
    full = estimate_advantages(
        samples,
        spec,
        **{k: junk(v) for k, v in kw.items()},
        **{k: junk(v) for k, v in kl.items()},
    )
    small = estimate_advantages(
        [_without_env(s) for s in samples],
        spec,
        **{k: keep(v) for k, v in kw.items()},
        **{k: keep(v) for k, v in kl.items()},
    )
    for got, want in zip(keep(full.advantages), small.advantages, strict=True):
        assert got == pytest.approx(want)
    for got, want in zip(keep(full.returns), small.returns, strict=True):
        assert got == pytest.approx(want)
    assert full.kl == pytest.approx(small.kl)
    for row, s in zip(full.advantages, samples, strict=True):
        assert all(x == 0.0 for x, m in zip(row, s.response.model_mask, strict=True) if not m)


def test_tensorize_carries_the_loss_mask() -> None:
    samples = (_episode(0, [(2, 1), (1, 0), (1, 1)], 1.0, 0), _episode(0, [(2, 1)], 0.0, 0))
    plain = Sample(Prompt(1, "", (1,)), Generation((5,), (0.0,), ""), 0.0, 1)
    tb = tensorize(
        TrainBatch(samples, advantages=tuple((1.0,) * len(s.response.token_ids) for s in samples)),
        pad_id=0,
    )
    assert tb.loss_mask.tolist() == [[True, True, False, True], [True, True, False, False]]
    assert tb.select(slice(1, 2)).loss_mask.tolist() == [[True, True, False, False]]
    single = tensorize(TrainBatch((plain,), advantages=((1.0,),)), pad_id=0)
    assert single.model_token_mask is None and single.loss_mask.tolist() == [[True]]


def test_generation_checks_its_loss_mask() -> None:
    with pytest.raises(ValueError, match="loss mask of 1"):
        Generation((1, 2), (0.0, 0.0), "", loss_mask=(1,))
    with pytest.raises(ValueError, match="0 or 1"):
        Generation((1,), (0.0,), "", loss_mask=(2,))
    assert Generation((1, 2), (0.0, 0.0), "").model_mask == (1, 1)
    assert Generation((1, 2), (0.0, 0.0), "", loss_mask=(1, 0)).model_tokens == 1
