"""Importance-sampling corrections of the engine/trainer mismatch: TIS, IcePop/MIS masking, the
geometric (sequence-level) variant, the veto, a custom function, and their place in the loss."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.correction import importance_weights
from rlcore.algorithms.losses import actor_loss
from rlcore.errors import ConfigError
from rlcore.specs import ISCorrection, LossSpec
from tests.algorithms.test_losses import batch_of
from tests.strategies import masked_floats

# Token ratios train/rollout: row 0 = [3, 0.5, 1], row 1 = [0.25] (then padding).
MASK = torch.tensor([[True, True, True], [True, False, False]])
ROLLOUT = torch.full((2, 3), -1.0, dtype=torch.float64)
TRAIN = ROLLOUT + torch.log(torch.tensor([[3.0, 0.5, 1.0], [0.25, 9.0, 9.0]], dtype=torch.float64))


def weights(spec: ISCorrection) -> torch.Tensor:
    return importance_weights(TRAIN, ROLLOUT, MASK, spec).weights


def test_tis_clips_each_token_ratio_into_the_bounds() -> None:
    out = importance_weights(TRAIN, ROLLOUT, MASK, ISCorrection(low=0.6, high=2.0))
    expected = torch.tensor([[2.0, 0.6, 1.0], [0.6, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.weights, expected)
    assert out.metrics["tis_weight"] == pytest.approx((2.0 + 0.6 + 1.0 + 0.6) / 4)
    assert out.metrics["tis_clipfrac"] == pytest.approx(3 / 4)  # 3, 0.5 and 0.25 moved


def test_mask_mode_zeroes_tokens_outside_the_bounds() -> None:
    out = importance_weights(TRAIN, ROLLOUT, MASK, ISCorrection(mode="mask", low=0.6, high=2.0))
    expected = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out.weights, expected)
    assert out.metrics["tis_weight"] == pytest.approx(1 / 4)
    assert out.metrics["tis_clipfrac"] == pytest.approx(3 / 4)


def test_geometric_level_gives_each_sequence_its_geometric_mean_ratio() -> None:
    geo = (3.0 * 0.5 * 1.0) ** (1 / 3)  # 1.1447: inside [0.6, 2]
    clip = weights(ISCorrection(level="geometric", low=0.6, high=2.0))
    torch.testing.assert_close(
        clip, torch.tensor([[geo, geo, geo], [0.6, 0.0, 0.0]], dtype=torch.float64)
    )
    mask = weights(ISCorrection(mode="mask", level="geometric", low=0.6, high=2.0))
    torch.testing.assert_close(
        mask, torch.tensor([[geo, geo, geo], [0.0, 0.0, 0.0]], dtype=torch.float64)
    )


def test_veto_zeroes_a_sequence_with_one_catastrophic_token() -> None:
    # Row 1's only token has ratio 0.25 < 0.3: vetoed. Row 0's smallest ratio is 0.5: kept.
    out = weights(ISCorrection(low=0.0, high=2.0, veto_threshold=0.3))
    expected = torch.tensor([[2.0, 0.5, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(out, expected)
    # A ratio below the threshold in row 0 vetoes the whole of row 0, whatever its other tokens.
    out = weights(ISCorrection(low=0.0, high=2.0, veto_threshold=0.6))
    torch.testing.assert_close(out, torch.zeros(2, 3, dtype=torch.float64))


def half_weights(
    train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, spec: ISCorrection
) -> torch.Tensor:
    """A custom correction for the test: every token at half weight."""
    del rollout, spec
    return torch.full_like(train, 0.5)


def wrong_shape(
    train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, spec: ISCorrection
) -> torch.Tensor:
    return torch.ones(1)


def test_a_custom_function_computes_the_weights() -> None:
    spec = ISCorrection(custom_path=f"{__name__}:half_weights")
    torch.testing.assert_close(
        weights(spec), torch.tensor([[0.5] * 3, [0.5, 0, 0]], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match=r"wrong_shape returned weights of shape \(1,\)"):
        weights(ISCorrection(custom_path=f"{__name__}:wrong_shape"))
    with pytest.raises(ConfigError, match="--custom-tis-function-path"):
        weights(ISCorrection(custom_path=f"{__name__}:no_such_function"))
    with pytest.raises(ConfigError, match="cannot be called with 4"):
        weights(ISCorrection(custom_path="math:sqrt"))


def test_the_spec_refuses_bounds_without_one() -> None:
    with pytest.raises(ValueError, match="0 <= low <= 1 <= high"):
        ISCorrection(low=1.2, high=2.0)
    with pytest.raises(ValueError, match="veto_threshold"):
        ISCorrection(veto_threshold=1.5)


def test_the_actor_loss_reweights_each_tokens_policy_loss() -> None:
    # One optimizer step: old = this pass's log-probs, ratio 1, so l_t = -A_t w_t.
    # Weights (TIS, [0.6, 2]): row 0 [2, 0.6, 1], row 1 [0.6]; A = 1 everywhere.
    # Row 0: -(2 + 0.6 + 1) / 3 = -1.2; row 1: -0.6. Sum -1.8; per sequence -0.9.
    logp = TRAIN.clone().requires_grad_(True)
    batch = attrs.evolve(batch_of(MASK, torch.ones(2, 3)), rollout_log_probs=ROLLOUT)
    spec = LossSpec(correction=ISCorrection(low=0.6, high=2.0))
    out = actor_loss(logp, batch, spec)
    assert out.loss.item() == pytest.approx(-1.8)
    assert out.metrics["pg_loss"] == pytest.approx(-0.9)
    assert out.metrics["tis_weight"] == pytest.approx(1.05)
    (grad,) = torch.autograd.grad(out.loss, logp)
    # d l_t / d logp_t = -A_t w_t / n_i (the weight is a constant).
    expected = torch.tensor([[-2 / 3, -0.2, -1 / 3], [-0.6, 0, 0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    # The mismatch metrics: |log 3|, |log 0.5|, 0, |log 0.25| -> mean and max.
    diffs = [math.log(3), math.log(2), 0.0, math.log(4)]
    assert out.metrics["logprob_mismatch"] == pytest.approx(sum(diffs) / 4)
    assert out.maxima["logprob_mismatch_max"] == pytest.approx(math.log(4))


def test_without_engine_log_probs_nothing_is_corrected() -> None:
    """A supervised warm start's batch has no engine log-probs: the loss is uncorrected."""
    logp = TRAIN.clone()
    spec = LossSpec(correction=ISCorrection(low=0.6, high=2.0))
    corrected = actor_loss(logp, batch_of(MASK, torch.ones(2, 3)), spec)
    plain = actor_loss(logp, batch_of(MASK, torch.ones(2, 3)), LossSpec())
    assert torch.equal(corrected.loss, plain.loss)
    assert "tis_weight" not in corrected.metrics and "logprob_mismatch" not in corrected.metrics


specs = st.builds(
    ISCorrection,
    mode=st.sampled_from(["clip", "mask"]),
    level=st.sampled_from(["token", "geometric"]),
    low=st.floats(0.0, 1.0),
    high=st.floats(1.0, 5.0),
    veto_threshold=st.one_of(st.none(), st.floats(1e-6, 0.9)),
)


@given(st.data(), masked_floats(), specs)
def test_weights_lie_in_the_stated_bounds(
    data: st.DataObject, case: tuple[torch.Tensor, torch.Tensor], spec: ISCorrection
) -> None:
    train, mask = case
    shift = torch.tensor(
        data.draw(st.lists(st.floats(-3, 3), min_size=train.numel(), max_size=train.numel())),
        dtype=torch.float64,
    ).reshape(train.shape)
    w = importance_weights(train, train + shift, mask, spec).weights
    valid = w[mask]
    inside = (valid >= spec.low) & (valid <= spec.high)
    assert bool((inside | (valid == 0)).all())
    assert bool((w[~mask] == 0).all())
    if spec.mode == "clip" and spec.veto_threshold is None:
        assert bool(inside.all())  # clipping never drops a token
    if spec.level == "geometric":  # one weight per sequence
        for row, m in zip(w, mask, strict=True):
            assert torch.unique(row[m]).numel() == 1


@given(masked_floats(), masked_floats(), specs)
def test_identical_log_probs_make_every_correction_the_identity(
    case: tuple[torch.Tensor, torch.Tensor],
    adv_case: tuple[torch.Tensor, torch.Tensor],
    spec: ISCorrection,
) -> None:
    log_probs, mask = case
    w = importance_weights(log_probs, log_probs, mask, spec).weights
    assert bool((w[mask] == 1.0).all())
    advantages = adv_case[0]
    if advantages.shape != log_probs.shape:
        advantages = torch.ones_like(log_probs)
    batch = attrs.evolve(batch_of(mask, advantages), rollout_log_probs=log_probs)
    logp = log_probs.clone().requires_grad_(True)
    corrected = actor_loss(logp, batch, LossSpec(correction=spec))
    plain = actor_loss(logp, attrs.evolve(batch, rollout_log_probs=None), LossSpec())
    assert torch.equal(corrected.loss, plain.loss)  # the loss equals today's, bit for bit
    (g1,) = torch.autograd.grad(corrected.loss, logp)
    (g2,) = torch.autograd.grad(plain.loss, logp)
    assert torch.equal(g1, g2)
    assert corrected.metrics["tis_weight"] == 1.0 and corrected.metrics["tis_clipfrac"] == 0.0
    assert corrected.metrics["logprob_mismatch"] == 0.0
