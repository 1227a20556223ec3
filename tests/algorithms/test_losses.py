"""PPO / GRPO policy loss, clipped value loss, and the actor and critic losses on a TensorBatch."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.batching import TensorBatch
from rlcore.algorithms.losses import actor_loss, critic_loss, policy_loss, value_loss
from rlcore.specs import LossSpec
from tests.strategies import finite, masked_floats


def batch_of(
    mask: torch.Tensor, advantages: torch.Tensor, **fields: torch.Tensor | None
) -> TensorBatch:
    """A TensorBatch whose token fields are placeholders: losses read only the per-token fields."""
    b, t = mask.shape
    return TensorBatch(
        tokens=torch.zeros(b, t + 1, dtype=torch.long),
        attention_mask=torch.ones(b, t + 1, dtype=torch.bool),
        response_index=torch.arange(t).expand(b, t),
        response_mask=mask,
        advantages=advantages,
        **fields,
    )


MASK = torch.tensor([[True, True, False], [True, False, False]])


# --- policy_loss --------------------------------------------------------------------------------


def test_policy_loss_by_hand() -> None:
    # Ratios e^{log r}: row 0 = [1.5, 0.5], row 1 = [1.1]; eps 0.2 / 0.2.
    # Row 0 token 0: A = 1, r = 1.5 -> min(1.5, 1.2) = 1.2 (clipped) -> -1.2.
    # Row 0 token 1: A = -1, r = 0.5 -> min(-0.5, -0.8) = -0.8 (clipped) -> 0.8. Mean: -0.2.
    # Row 1 token 0: A = 2, r = 1.1 -> 2.2 (inside) -> -2.2. Sum over sequences: -2.4.
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 0.5, 7.0], [1.1, 7.0, 7.0]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -1.0, 5.0], [2.0, 5.0, 5.0]], dtype=torch.float64)
    out = policy_loss(logp, old, adv, MASK, eps_clip=0.2, eps_clip_high=0.2)
    assert out.loss.item() == pytest.approx(-2.4)
    assert out.clipfrac.item() == pytest.approx(2.0 / 3.0)
    # approx_kl: k3 with r = new / old per token: r - 1 - log r, token mean.
    k3 = [r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)]
    assert out.approx_kl.item() == pytest.approx(sum(k3) / 3)
    assert not out.clipfrac.requires_grad and not out.approx_kl.requires_grad


def test_clip_higher_uses_the_upper_bound_for_positive_advantages() -> None:
    old = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.5]]))
    adv = torch.ones(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    assert policy_loss(logp, old, adv, mask, 0.2, 0.28).loss.item() == pytest.approx(-1.28)
    assert policy_loss(logp, old, adv, mask, 0.2, 0.6).loss.item() == pytest.approx(-1.5)


def test_zero_clip_at_ratio_one_keeps_the_full_gradient() -> None:
    logp = torch.tensor([[-0.7, -1.3]], requires_grad=True)
    adv = torch.tensor([[2.0, -3.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(logp, logp.detach(), adv, mask, eps_clip=0.0, eps_clip_high=0.0)
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.allclose(grad, torch.tensor([[-1.0, 1.5]]))  # -A / n
    assert out.clipfrac.item() == 0.0


@given(st.data(), masked_floats())
def test_clipped_loss_equals_unclipped_inside_the_trust_region(
    data: st.DataObject, case: tuple[torch.Tensor, torch.Tensor]
) -> None:
    advantages, mask = case
    log_ratio = torch.tensor(
        data.draw(st.lists(st.floats(-0.15, 0.15), min_size=mask.numel(), max_size=mask.numel())),
        dtype=torch.float64,
    ).reshape(mask.shape)  # |log r| <= 0.15 keeps r inside [0.8, 1.2]
    old = torch.full(mask.shape, -1.0, dtype=torch.float64)
    logp = (old + log_ratio).requires_grad_(True)
    clipped = policy_loss(logp, old, advantages, mask, 0.2, 0.2)
    (grad_clipped,) = torch.autograd.grad(clipped.loss, logp)
    ratio = torch.exp(logp - old)
    unclipped = (torch.where(mask, -ratio * advantages, 0.0).sum(1) / mask.sum(1)).sum()
    (grad_unclipped,) = torch.autograd.grad(unclipped, logp)
    assert clipped.loss.item() == pytest.approx(unclipped.item(), abs=1e-9)
    assert torch.allclose(grad_clipped, grad_unclipped, atol=1e-12)
    assert clipped.clipfrac.item() == 0.0


# --- actor_loss ---------------------------------------------------------------------------------


def bench_tiny_loss(logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """bench-tiny WORKLOAD.md section 5, verbatim."""
    per_tok = -torch.exp(logp - logp.detach()) * adv
    m = mask.to(logp.dtype)
    return ((m * per_tok).sum(1) / m.sum(1).clamp_min(1)).mean()


@given(st.data(), masked_floats())
def test_actor_loss_without_old_log_probs_is_bench_tiny_and_has_its_gradient(
    data: st.DataObject, case: tuple[torch.Tensor, torch.Tensor]
) -> None:
    logits, mask = case
    per_seq = torch.tensor(
        data.draw(st.lists(finite, min_size=mask.shape[0], max_size=mask.shape[0])),
        dtype=torch.float32,
    )
    adv = per_seq.unsqueeze(1) * mask  # per-sequence GRPO advantages, 0 on padding
    logp = torch.log_softmax(logits.float(), dim=1).requires_grad_(True)
    b = mask.shape[0]
    out = actor_loss(logp, batch_of(mask, adv), LossSpec())
    reference = bench_tiny_loss(logp, adv, mask)
    assert torch.equal(out.loss / b, reference)
    (grad,) = torch.autograd.grad(out.loss / b, logp)
    n = mask.sum(1, keepdim=True)
    # -mean_i (A_i / n_i) sum_t grad logp_it, i.e. -A_i / (n_i B) on each valid token.
    assert torch.allclose(grad, -(adv / n) / b * mask, atol=1e-7)
    assert out.metrics["clipfrac"] == 0.0 and out.metrics["approx_kl"] == 0.0
    assert out.metrics["loss"] == pytest.approx(reference.item(), abs=1e-6)


def test_actor_loss_with_kl_and_entropy_terms_by_hand() -> None:
    # One sequence of 2 tokens, ratio 1 (old = None), A = [1, 1]:
    #   pg = -1; k1 KL = logp - ref = [0.5, 0.5] -> 0.5; entropy mean 2.
    #   loss = -1 + 0.1 * 0.5 - 0.01 * 2 = -0.97
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    batch = batch_of(mask, torch.ones(1, 2), ref_log_probs=torch.tensor([[-1.5, -1.5]]))
    spec = LossSpec(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01)
    out = actor_loss(logp, batch, spec, entropy=torch.tensor([[1.0, 3.0]]))
    assert out.loss.item() == pytest.approx(-0.97)
    assert out.metrics == pytest.approx(
        {
            "pg_loss": -1.0,
            "clipfrac": 0.0,
            "approx_kl": 0.0,
            "kl_loss": 0.5,
            "entropy": 2.0,
            "loss": -0.97,
        }
    )
    (grad,) = torch.autograd.grad(out.loss, logp)
    # d/dlogp: pg -A/n = -0.5, KL 0.1/n = 0.05.
    assert torch.allclose(grad, torch.tensor([[-0.45, -0.45]]))


def test_actor_loss_reports_the_rollout_log_prob_mismatch() -> None:
    mask = torch.tensor([[True, True], [True, False]])
    logp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0], [-0.25, -9.0]])  # the padded entry must not count
    out = actor_loss(
        logp, attrs.evolve(batch_of(mask, torch.ones(2, 2)), rollout_log_probs=rollout), LossSpec()
    )
    assert out.metrics["logprob_mismatch"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)


def test_actor_loss_uses_old_log_probs_when_present() -> None:
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = torch.log(torch.tensor([[1.5]]))
    batch = batch_of(mask, torch.ones(1, 1), old_log_probs=torch.zeros(1, 1))
    out = actor_loss(logp, batch, LossSpec(eps_clip=0.2, eps_clip_high=0.2))
    assert out.loss.item() == pytest.approx(-1.2)
    assert out.metrics["clipfrac"] == 1.0


def test_actor_loss_names_missing_inputs() -> None:
    mask = torch.ones(1, 1, dtype=torch.bool)
    batch = batch_of(mask, torch.ones(1, 1))
    with pytest.raises(ValueError, match="no ref_log_probs"):
        actor_loss(torch.zeros(1, 1), batch, LossSpec(use_kl_loss=True, kl_loss_coef=0.1))
    with pytest.raises(ValueError, match="needs entropy"):
        actor_loss(torch.zeros(1, 1), batch, LossSpec(entropy_coef=0.01))


# --- value_loss / critic_loss -------------------------------------------------------------------


def test_value_loss_by_hand() -> None:
    # Row 0: v = [1, 0], old = [0, 0], R = [2, -1], clip 0.5.
    #   token 0: unclipped (1 - 2)^2 = 1; v_clip = 0.5 -> (0.5 - 2)^2 = 2.25; max -> 0.5 * 2.25
    #   token 1: unclipped 1; v_clip = 0 -> 1; -> 0.5. Mean: (1.125 + 0.5) / 2 = 0.8125
    # Row 1: v = [3], old = [3], R = [1] -> 0.5 * 4 = 2. Sum: 2.8125.
    values = torch.tensor([[1.0, 0.0, 9.0], [3.0, 9.0, 9.0]])
    old = torch.tensor([[0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, -1.0, 0.0], [1.0, 0.0, 0.0]])
    assert value_loss(values, old, returns, MASK, 0.5).item() == pytest.approx(2.8125)
    # Unclipped: row 0 (1 + 1) / 2 * 0.5 = 0.5, row 1 2 -> 2.5.
    assert value_loss(values, None, returns, MASK, 0.5).item() == pytest.approx(2.5)


def test_critic_loss_metrics_and_gradient() -> None:
    values = torch.tensor([[1.0, 0.0, 9.0], [3.0, 9.0, 9.0]], requires_grad=True)
    batch = batch_of(
        MASK,
        torch.zeros(2, 3),
        returns=torch.tensor([[2.0, -1.0, 0.0], [1.0, 0.0, 0.0]]),
        old_values=torch.tensor([[0.0, 0.0, 0.0], [3.0, 0.0, 0.0]]),
    )
    out = critic_loss(values, batch, LossSpec(value_clip=0.5))
    assert out.loss.item() == pytest.approx(2.8125)
    assert out.metrics == pytest.approx(
        {
            "value_loss": 2.8125 / 2,
            "value_clipfrac": 1.0 / 3.0,
            "values": 4.0 / 3.0,
            "loss": 2.8125 / 2,
        }
    )
    (grad,) = torch.autograd.grad(out.loss, values)
    # Token (0, 0) is clipped (zero gradient); (0, 1): (v - R) / n = 0.5; (1, 0): (3 - 1) / 1 = 2.
    assert torch.allclose(grad, torch.tensor([[0.0, 0.5, 0.0], [2.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="needs batch.returns"):
        critic_loss(values, attrs.evolve(batch, returns=None), LossSpec())
