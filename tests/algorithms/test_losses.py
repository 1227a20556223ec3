"""PPO / GRPO policy loss, clipped value loss, and the actor and critic losses on a TensorBatch."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.batching import TensorBatch
from rlcore.algorithms.losses import (
    actor_loss,
    aggregate,
    critic_loss,
    loss_normalizer,
    policy_loss,
    value_loss,
)
from rlcore.config import structure_config
from rlcore.loop.plan import TrainPlan, plan
from rlcore.specs import ISCorrection, LossAggMode, LossSpec
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


def test_dual_clip_bounds_a_negative_advantages_loss_at_c_times_its_size() -> None:
    # eps 0.2, c = 3. Ratios 4, 2.5, 4, 0.5 with advantages -1, -1, +1, -1:
    # r = 4, A = -1: PPO's clipped loss max(4, 1.2) = 4 > c |A| = 3 -> 3 (dual-clipped).
    # r = 2.5, A = -1: max(2.5, 1.2) = 2.5 <= 3 -> 2.5 (PPO's unclipped branch).
    # r = 4, A = +1: -min(4, 1.2) = -1.2 (clipped above; the dual clip is for A < 0 only).
    # r = 0.5, A = -1: -min(-0.5, -0.8) = 0.8 (clipped below, under the bound).
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.log(torch.tensor([[4.0, 2.5, 4.0, 0.5]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    plain = policy_loss(logp, old, adv, mask, 0.2, 0.2, agg_mode="token-mean")
    dual = policy_loss(logp, old, adv, mask, 0.2, 0.2, eps_clip_c=3.0, agg_mode="token-mean")
    assert plain.loss.item() == pytest.approx(4.0 + 2.5 - 1.2 + 0.8)
    assert dual.loss.item() == pytest.approx(3.0 + 2.5 - 1.2 + 0.8)
    assert plain.dual_clipfrac.item() == 0.0 and dual.dual_clipfrac.item() == 0.25
    assert dual.clipfrac.item() == plain.clipfrac.item() == 0.5  # PPO's clip, as verl counts it
    (grad,) = torch.autograd.grad(dual.loss, logp)
    # d(-r A)/d logp = -r A: 2.5 for the second token; the bounded and clipped ones get none.
    assert grad.tolist() == [[0.0, 2.5, 0.0, 0.0]]


def test_dual_clip_needs_a_bound_above_one() -> None:
    with pytest.raises(ValueError, match=r"LossSpec.eps_clip_c must be > 1 .*got 1.0"):
        LossSpec(eps_clip_c=1.0)
    assert LossSpec().eps_clip_c is None  # off by default, as slime's --eps-clip-c


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


# --- aggregation modes --------------------------------------------------------------------------

# Per-token losses l = [[1, 2], [3]] (padding holds junk): as policy losses with ratio 1, A = -l.
PER_TOKEN = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("mode", "numerator", "normalizer"),
    [
        ("seq-mean-token-mean", (1 + 2) / 2 + 3 / 1, 2),  # mean of sequence means: 2.25
        ("token-mean", 1 + 2 + 3, 3),  # mean over the 3 tokens: 2.0
        ("seq-mean-token-sum-budget", (1 + 2 + 3) / 4, 2),  # Dr. GRPO, C = 4: 0.75
    ],
)
def test_each_aggregation_mode_by_hand(
    mode: LossAggMode, numerator: float, normalizer: int
) -> None:
    assert aggregate(PER_TOKEN, MASK, mode, 4).item() == pytest.approx(numerator)
    assert loss_normalizer(mode, MASK) == normalizer
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    spec = LossSpec(agg_mode=mode, agg_constant=4)
    out = actor_loss(logp, batch_of(MASK, -PER_TOKEN), spec)
    assert out.loss.item() == pytest.approx(numerator)
    assert out.normalizer == normalizer
    assert out.metrics["loss"] == pytest.approx(numerator / normalizer)
    (grad,) = torch.autograd.grad(out.loss / loss_normalizer(mode, MASK), logp)
    # dl/dlogp = -A = l, scaled by each mode's per-token weight.
    weight = {
        "seq-mean-token-mean": [[1 / 2 / 2, 1 / 2 / 2, 0], [1 / 2, 0, 0]],
        "token-mean": [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]],
        "seq-mean-token-sum-budget": [[1 / 8, 1 / 8, 0], [1 / 8, 0, 0]],
    }[mode]
    expected = PER_TOKEN * torch.tensor(weight, dtype=torch.float64)
    torch.testing.assert_close(grad, expected)


@given(masked_floats(), st.sampled_from(["seq-mean-token-mean", "token-mean"]))
def test_splitting_a_batch_leaves_the_aggregate_unchanged(
    case: tuple[torch.Tensor, torch.Tensor], mode: LossAggMode
) -> None:
    """Micro-batches' numerators over the global normaliser sum to the whole batch's aggregate:
    what gradient accumulation over micro-batches and data-parallel ranks relies on."""
    x, mask = case
    whole = aggregate(x, mask, mode) / loss_normalizer(mode, mask)
    parts = sum(aggregate(x[i : i + 1], mask[i : i + 1], mode) for i in range(x.shape[0]))
    assert float(parts / loss_normalizer(mode, mask)) == pytest.approx(float(whole), abs=1e-9)


# --- GSPO: the sequence-level ratio ------------------------------------------------------------


def test_gspo_uses_one_geometric_mean_ratio_per_sequence() -> None:
    # Row 0: token ratios [1.5, 0.5], A = 1. Token level: token 0 clipped at 1.2, token 1 gives
    # min(0.5, 0.8) = 0.5: mean -(1.2 + 0.5) / 2 = -0.85. GSPO: s = sqrt(1.5 * 0.5) = 0.866,
    # inside [0.8, 1.2]: -0.866 on both tokens, mean -0.866.
    # Row 1: ratio [1.1], A = 2: -2.2 either way.
    old = torch.zeros(2, 3, dtype=torch.float64)
    ratios = torch.tensor([[1.5, 0.5, 7.0], [1.1, 7.0, 7.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 5.0], [2.0, 5.0, 5.0]], dtype=torch.float64)
    token = policy_loss(torch.log(ratios), old, adv, MASK, 0.2, 0.2)
    assert token.loss.item() == pytest.approx(-0.85 - 2.2)
    logp = torch.log(ratios).requires_grad_(True)
    seq = policy_loss(logp, old, adv, MASK, 0.2, 0.2, ratio_level="sequence")
    s = math.sqrt(0.75)
    assert seq.loss.item() == pytest.approx(-s - 2.2)
    assert seq.clipfrac.item() == 0.0
    (grad,) = torch.autograd.grad(seq.loss, logp)
    # The sequence's loss is -A s (the token mean of a constant); d(-A s)/dlogp_t = -A s / n for
    # every token t of it, since log s is the mean of the token log-ratios.
    expected = torch.tensor([[-s / 2, -s / 2, 0.0], [-2.2, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)


def test_gspo_clips_the_whole_sequence() -> None:
    # Token ratios [2, 1], A = 1: s = sqrt(2) = 1.414 > 1.2, so the whole sequence is clipped and
    # gets no gradient, although its second token's own ratio (1) is inside the trust region.
    mask = torch.tensor([[True, True]])
    logp = torch.log(torch.tensor([[2.0, 1.0]], dtype=torch.float64)).requires_grad_(True)
    old, adv = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    out = policy_loss(logp, old, adv, mask, 0.2, 0.2, ratio_level="sequence")
    assert out.loss.item() == pytest.approx(-1.2)
    assert out.clipfrac.item() == 1.0
    (grad,) = torch.autograd.grad(out.loss, logp)
    assert torch.equal(grad, torch.zeros_like(grad))
    token = policy_loss(logp, old, adv, mask, 0.2, 0.2)
    (token_grad,) = torch.autograd.grad(token.loss, logp)
    assert token_grad[0, 1].item() == pytest.approx(-0.5)  # token level: token 1 still learns


# --- the flags reach the loss ------------------------------------------------------------------


def _actor_spec(**algorithm: object) -> LossSpec:
    config = structure_config(
        {
            "rollout": {"num_rollout": 1, "max_response_len": 12},
            "train": {"global_batch_size": 32},
            "algorithm": algorithm,
        }
    )
    the_plan = plan(config)
    assert isinstance(the_plan, TrainPlan)
    return the_plan.actor.loss


def test_eps_clip_high_is_wired_from_the_flag_to_the_loss() -> None:
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = torch.log(torch.tensor([[1.5]]))
    batch = batch_of(mask, torch.ones(1, 1), old_log_probs=torch.zeros(1, 1))
    clip_higher = _actor_spec(eps_clip=0.2, eps_clip_high=0.28)
    assert (clip_higher.eps_clip, clip_higher.eps_clip_high) == (0.2, 0.28)
    assert actor_loss(logp, batch, clip_higher).loss.item() == pytest.approx(-1.28)
    symmetric = _actor_spec(eps_clip=0.2)  # --eps-clip-high defaults to --eps-clip
    assert actor_loss(logp, batch, symmetric).loss.item() == pytest.approx(-1.2)


def test_eps_clip_c_is_wired_from_the_flag_to_the_loss_and_its_metric() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.log(torch.tensor([[4.0, 1.0]]))  # ratio 4 against old log-probs 0
    batch = batch_of(mask, torch.tensor([[-1.0, 1.0]]), old_log_probs=torch.zeros(1, 2))
    spec = _actor_spec(eps_clip_c=3.0)
    assert spec.eps_clip_c == 3.0 and _actor_spec().eps_clip_c is None
    out = actor_loss(logp, batch, spec)
    assert out.loss.item() == pytest.approx((3.0 - 1.0) / 2)  # token 0 bounded at 3, token 1: -1
    assert out.metrics["dual_clipfrac"] == 0.5 and "dual_clipfrac" in out.token_metrics
    assert "dual_clipfrac" not in actor_loss(logp, batch, _actor_spec()).metrics


def test_the_loss_flags_reach_the_loss_spec() -> None:
    assert _actor_spec().agg_mode == "seq-mean-token-mean"
    assert _actor_spec(calculate_per_token_loss=True).agg_mode == "token-mean"
    dr_grpo = _actor_spec(loss_agg_mode="seq-mean-token-sum-budget")
    assert (dr_grpo.agg_mode, dr_grpo.agg_constant) == ("seq-mean-token-sum-budget", 12)
    assert _actor_spec(advantage_estimator="gspo").ratio_level == "sequence"
    assert _actor_spec().ratio_level == "token" and _actor_spec().correction is None
    tis = _actor_spec(
        use_tis=True,
        tis_clip=1.5,
        tis_clip_low=0.5,
        tis_mode="mask",
        tis_level="geometric",
        tis_veto_threshold=1e-4,
    )
    assert tis.correction == ISCorrection(
        mode="mask", level="geometric", low=0.5, high=1.5, veto_threshold=1e-4
    )
    assert _actor_spec(use_rollout_logprobs=True).use_rollout_logprobs
