"""Advantage estimators: GRPO, Dr. GRPO, REINFORCE++ (-baseline), GAE, and the list-level entry."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.advantages import (
    Advantages,
    estimate_advantages,
    gae,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from rlcore.samples import Generation, Prompt, Sample
from rlcore.specs import AdvantageEstimator, AdvantageSpec
from tests.strategies import finite, grouped_samples, masked_floats, rows_for

ESTIMATORS: tuple[AdvantageEstimator, ...] = (
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "ppo",
)


def sample(reward: float, length: int, group: int = 0) -> Sample:
    tokens = tuple(range(3, 3 + length))
    return Sample(
        prompt=Prompt(index=group, text="", token_ids=(1,)),
        response=Generation(token_ids=tokens, log_probs=tuple(-1.0 for _ in tokens), text=""),
        reward=reward,
        group=group,
    )


def t64(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- GRPO ---------------------------------------------------------------------------------------


def test_grpo_by_hand() -> None:
    # Group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5. Group 2: all equal.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    got = grpo_advantages(rewards, group_size=4, eps=1e-12)
    assert got.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    # The default eps is added to the std: 0.75 / (0.5 + 1e-6).
    assert grpo_advantages(rewards, 4)[0].item() == pytest.approx(0.75 / (0.5 + 1e-6), rel=1e-12)


def test_dr_grpo_only_centres() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    got = grpo_advantages(rewards, group_size=4, normalize_std=False)
    assert got.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_grpo_group_of_one_has_zero_advantage() -> None:
    assert grpo_advantages(torch.tensor([3.0, -1.0]), group_size=1).tolist() == [0.0, 0.0]


def test_grpo_refuses_ragged_groups() -> None:
    with pytest.raises(ValueError, match="5 samples do not split into groups of 2"):
        grpo_advantages(torch.zeros(5), group_size=2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        grpo_advantages(torch.zeros(4), group_size=0)


@given(
    st.integers(1, 6).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.lists(finite, min_size=g, max_size=4 * g).map(lambda r: r[: len(r) // g * g]),
        )
    ),
    st.booleans(),
)
def test_each_grpo_group_sums_to_zero(case: tuple[int, list[float]], normalize_std: bool) -> None:
    group_size, rewards = case
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = grpo_advantages(r, group_size, normalize_std, eps=1e-6)
    for group in adv.reshape(-1, group_size):
        assert abs(group.sum().item()) < 1e-9 * (1 + group.abs().sum().item())
    if normalize_std and group_size > 1:
        # Normalised groups have unbiased std s / (s + eps), s the rewards' std: 1 up to eps.
        for group, raw in zip(adv.reshape(-1, group_size), r.reshape(-1, group_size), strict=True):
            s = raw.std(correction=1).item()
            assert group.std(correction=1).item() == pytest.approx(s / (s + 1e-6), abs=1e-9)


# --- RLOO ---------------------------------------------------------------------------------------


def test_rloo_by_hand() -> None:
    # Group 1 (1, 0, 0, 0): the first's baseline is 0 -> 1; each other's is 1/3 -> -1/3.
    # Group 2 (2, 4): each one's baseline is the other's reward -> -2, 2.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 3.0, 3.0], dtype=torch.float64)
    got = rloo_advantages(rewards[:4], group_size=4)
    assert got.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert rloo_advantages(rewards[4:], group_size=2).tolist() == [-2.0, 2.0, 0.0, 0.0]


def test_rloo_group_of_one_has_zero_advantage() -> None:
    assert rloo_advantages(torch.tensor([3.0, -1.0]), group_size=1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="5 samples do not split into groups of 2"):
        rloo_advantages(torch.zeros(5), group_size=2)


def test_estimate_rloo_scores_the_summed_token_rewards_like_the_other_grouped_estimators() -> None:
    # KL in the reward as for GRPO: sample 0's score 1 - 0.1 * 1 = 0.9, sample 1's 0; RLOO with
    # two samples is the difference: +-0.9, on every token.
    samples = [sample(1.0, 2), sample(0.0, 1)]
    spec = AdvantageSpec(estimator="rloo", group_size=2, kl_coef=0.1, kl_type="k1")
    got = estimate_advantages(
        samples, spec, log_probs=((-1.0, -1.0), (-2.0,)), ref_log_probs=((-1.5, -1.5), (-2.0,))
    )
    assert got.advantages[0] == pytest.approx((0.9, 0.9))
    assert got.advantages[1] == pytest.approx((-0.9,))
    assert got.returns == got.advantages  # nothing added, not whitened
    whitened = estimate_advantages(
        samples,
        attrs.evolve(spec, whiten=True),
        log_probs=((-1.0, -1.0), (-2.0,)),
        ref_log_probs=((-1.5, -1.5), (-2.0,)),
    )  # --normalize-advantages applies to it as to any estimator: [0.9, 0.9, -0.9] whitened
    assert [a for r in whitened.advantages for a in r] != pytest.approx([0.9, 0.9, -0.9])
    assert sum(a for r in whitened.advantages for a in r) == pytest.approx(0.0, abs=1e-12)


@given(
    st.integers(2, 6).flatmap(
        lambda g: st.tuples(st.just(g), st.lists(finite, min_size=g, max_size=4 * g))
    )
)
def test_rloo_is_dr_grpo_scaled_by_n_over_n_minus_one(case: tuple[int, list[float]]) -> None:
    group_size, rewards = case
    r = torch.tensor(rewards[: len(rewards) // group_size * group_size], dtype=torch.float64)
    scale = group_size / (group_size - 1)
    want = scale * grpo_advantages(r, group_size, normalize_std=False)
    assert torch.allclose(rloo_advantages(r, group_size), want, atol=1e-12)


# --- REINFORCE++ --------------------------------------------------------------------------------


def test_reinforce_plus_plus_by_hand() -> None:
    # Discounted returns with gamma 0.5: [0.25, 0.5, 1] and [1, 2]; over the 5 valid tokens
    # mean 0.95, squared deviations summing to 1.8: unbiased variance 1.8 / 4 = 0.45.
    rewards = t64([[0.0, 0.0, 1.0], [0.0, 2.0, 99.0]])  # 99 sits on padding and is ignored
    mask = torch.tensor([[True, True, True], [True, True, False]])
    got = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    s = math.sqrt(0.45 + 1e-8)
    want = [[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0]]
    assert got.tolist()[0] == pytest.approx(want[0])
    assert got.tolist()[1] == pytest.approx(want[1])


def test_reinforce_plus_plus_baseline_by_hand() -> None:
    # Group means 0.5 and 2: centred [0.5, -0.5, 1, -1]; broadcast to 1, 1, 2, 2 tokens:
    # [0.5, -0.5, 1, 1, -1, -1], mean 0, unbiased variance 4.5 / 5 = 0.9.
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0], dtype=torch.float64)
    mask = torch.tensor([[True, False], [True, False], [True, True], [True, True]])
    got = reinforce_plus_plus_baseline_advantages(rewards, 2, mask)
    s = math.sqrt(0.9 + 1e-8)
    want = [[0.5 / s, 0.0], [-0.5 / s, 0.0], [1 / s, 1 / s], [-1 / s, -1 / s]]
    for row, w in zip(got.tolist(), want, strict=True):
        assert row == pytest.approx(w)


@given(masked_floats(), st.floats(0.0, 1.0))
def test_reinforce_plus_plus_is_whitened_over_valid_tokens(
    case: tuple[torch.Tensor, torch.Tensor], gamma: float
) -> None:
    rewards, mask = case
    adv = reinforce_plus_plus_advantages(rewards, mask, gamma)
    assert torch.all(adv[~mask] == 0)
    valid = adv[mask]
    assert abs(valid.mean().item()) < 1e-6
    if valid.numel() == 1:  # its own mean
        assert valid.item() == 0.0
        return
    # Unbiased variance v / (v + 1e-8), v the returns' unbiased variance: 1 unless v is tiny.
    masked = (rewards * mask).tolist()
    to_go = [
        [sum(gamma**k * r for k, r in enumerate(row[t:])) for t in range(len(row))]
        for row in masked
    ]
    v = torch.tensor(to_go, dtype=torch.float64)[mask].var(correction=1).item()
    assert valid.var(correction=1).item() == pytest.approx(v / (v + 1e-8), rel=1e-6, abs=1e-9)


# --- GAE ----------------------------------------------------------------------------------------


def test_gae_by_hand() -> None:
    # Row 0, gamma 0.9, lambda 0.8: deltas 0.04, 0.03, 0.3 (V after the end is 0);
    # A2 = 0.3, A1 = 0.03 + 0.72 * 0.3 = 0.246, A0 = 0.04 + 0.72 * 0.246 = 0.21712.
    # Row 1 has one token: A = 2 - 0.5 = 1.5, return 2. Its padding values are ignored.
    rewards = t64([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]])
    values = t64([[0.5, 0.6, 0.7], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lambd=0.8)
    assert adv.tolist()[0] == pytest.approx([0.21712, 0.246, 0.3])
    assert ret.tolist()[0] == pytest.approx([0.71712, 0.846, 1.0])
    assert adv.tolist()[1] == pytest.approx([1.5, 0.0, 0.0])
    assert ret.tolist()[1] == pytest.approx([2.0, 0.0, 0.0])


def draw_like(data: st.DataObject, x: torch.Tensor) -> torch.Tensor:
    flat = data.draw(st.lists(finite, min_size=x.numel(), max_size=x.numel()))
    return torch.tensor(flat, dtype=torch.float64).reshape(x.shape)


@given(st.data(), masked_floats())
def test_gae_with_unit_gamma_and_lambda_is_reward_to_go_minus_value(
    data: st.DataObject, case: tuple[torch.Tensor, torch.Tensor]
) -> None:
    rewards, mask = case
    values = draw_like(data, rewards)
    adv, ret = gae(rewards, values, mask, gamma=1.0, lambd=1.0)
    to_go = (rewards * mask).flip(1).cumsum(1).flip(1) * mask
    assert torch.allclose(ret, to_go, atol=1e-9)
    assert torch.allclose(adv, (to_go - values) * mask, atol=1e-9)


@given(st.data(), masked_floats(), st.floats(0.0, 1.0))
def test_gae_with_lambda_zero_is_the_td_residual(
    data: st.DataObject, case: tuple[torch.Tensor, torch.Tensor], gamma: float
) -> None:
    rewards, mask = case
    values = draw_like(data, rewards)
    adv, _ = gae(rewards, values, mask, gamma=gamma, lambd=0.0)
    v = values * mask
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    assert torch.allclose(adv, (rewards + gamma * next_v - v) * mask, atol=1e-9)


# --- estimate_advantages ------------------------------------------------------------------------


def test_estimate_grpo_broadcasts_per_sequence_and_counts_empty_responses() -> None:
    # Group 0: rewards 1 and 0 (the second has no tokens but still counts); the unbiased std of
    # (1, 0) is sqrt(0.5), so A = (1 - 0.5) / sqrt(0.5). Group 1's rewards are equal: A = 0.
    samples = [
        sample(1.0, 2, group=0),
        sample(0.0, 0, group=0),
        sample(5.0, 1, group=1),
        sample(5.0, 3, group=1),
    ]
    got = estimate_advantages(samples, AdvantageSpec(estimator="grpo", group_size=2))
    a = 0.5 / math.sqrt(0.5)
    assert got.advantages[0] == pytest.approx((a, a), rel=1e-5)
    assert got.advantages[1] == ()
    assert got.advantages[2:] == ((0.0,), (0.0, 0.0, 0.0))
    assert got.returns == got.advantages
    assert got.kl == 0.0


def test_estimate_grpo_with_a_kl_penalty_scores_the_summed_token_rewards() -> None:
    # k1 per token = logp - ref. Sample 0: KL sum 0.5 + 0.5 = 1 -> score 1 - 0.1 * 1 = 0.9;
    # sample 1: KL 0 -> score 0. Dr. GRPO: A = +-0.45. Mean KL over 3 tokens = 1/3.
    samples = [sample(1.0, 2), sample(0.0, 1)]
    spec = AdvantageSpec(
        estimator="grpo", group_size=2, kl_coef=0.1, kl_type="k1", normalize_std=False
    )
    got = estimate_advantages(
        samples, spec, log_probs=((-1.0, -1.0), (-2.0,)), ref_log_probs=((-1.5, -1.5), (-2.0,))
    )
    assert got.advantages[0] == pytest.approx((0.45, 0.45))
    assert got.advantages[1] == pytest.approx((-0.45,))
    assert got.kl == pytest.approx(1.0 / 3.0)


def test_estimate_reinforce_plus_plus_puts_the_reward_on_the_last_token() -> None:
    # Same numbers as test_reinforce_plus_plus_by_hand.
    samples = [sample(1.0, 3), sample(2.0, 2)]
    got = estimate_advantages(
        samples, AdvantageSpec(estimator="reinforce_plus_plus", group_size=1, gamma=0.5)
    )
    s = math.sqrt(0.45 + 1e-8)
    assert got.advantages[0] == pytest.approx((-0.7 / s, -0.45 / s, 0.05 / s))
    assert got.advantages[1] == pytest.approx((0.05 / s, 1.05 / s))
    # The returns are the discounted returns themselves, before whitening.
    assert got.returns == ((0.25, 0.5, 1.0), (1.0, 2.0))


def test_estimate_reinforce_plus_plus_with_kl_penalises_every_token() -> None:
    # gamma 1, kl_coef 1, k1 = 1 on each of 2 tokens: token rewards [-1, 1 - 1] -> returns [-1, 0],
    # and a second one-token sample with KL 0 and reward 1 -> return 1. Over [-1, 0, 1]: mean 0,
    # unbiased variance 2 / 2 = 1.
    samples = [sample(1.0, 2), sample(1.0, 1)]
    spec = AdvantageSpec(estimator="reinforce_plus_plus", group_size=1, kl_coef=1.0)
    got = estimate_advantages(
        samples, spec, log_probs=((0.0, 0.0), (0.0,)), ref_log_probs=((-1.0, -1.0), (0.0,))
    )
    s = math.sqrt(1.0 + 1e-8)
    assert got.advantages[0] == pytest.approx((-1.0 / s, 0.0))
    assert got.advantages[1] == pytest.approx((1.0 / s,))
    assert got.kl == pytest.approx(2.0 / 3.0)


def test_estimate_reinforce_plus_plus_baseline() -> None:
    samples = [sample(1.0, 1, 0), sample(0.0, 1, 0), sample(3.0, 2, 1), sample(1.0, 2, 1)]
    got = estimate_advantages(
        samples, AdvantageSpec(estimator="reinforce_plus_plus_baseline", group_size=2)
    )
    s = math.sqrt(0.9 + 1e-8)  # as in test_reinforce_plus_plus_baseline_by_hand
    want = ((0.5 / s,), (-0.5 / s,), (1 / s, 1 / s), (-1 / s, -1 / s))
    for row, w in zip(got.advantages, want, strict=True):
        assert row == pytest.approx(w)


def test_estimate_ppo_runs_gae_with_the_critic_values() -> None:
    samples = [sample(1.0, 3), sample(2.0, 1)]
    spec = AdvantageSpec(estimator="ppo", group_size=1, gamma=0.9, lambd=0.8)
    got = estimate_advantages(samples, spec, values=((0.5, 0.6, 0.7), (0.5,)))
    assert got.advantages[0] == pytest.approx((0.21712, 0.246, 0.3))
    assert got.returns[0] == pytest.approx((0.71712, 0.846, 1.0))
    assert got.advantages[1] == pytest.approx((1.5,))
    assert got.returns[1] == pytest.approx((2.0,))


def test_whitened_ppo_advantages_keep_the_critic_returns() -> None:
    samples = [sample(1.0, 3), sample(2.0, 1)]
    values = ((0.5, 0.6, 0.7), (0.5,))
    plain = AdvantageSpec(estimator="ppo", group_size=1, gamma=0.9, lambd=0.8)
    got = estimate_advantages(samples, attrs.evolve(plain, whiten=True), values=values)
    # GAE gives 0.21712, 0.246, 0.3 and 1.5 (the test above); whitened over those four tokens
    # with the unbiased variance (divided by 4 - 1), as slime and verl whiten:
    raw = [0.21712, 0.246, 0.3, 1.5]
    mean = sum(raw) / 4
    std = math.sqrt(sum((a - mean) ** 2 for a in raw) / 3 + 1e-8)
    flat = [a for row in got.advantages for a in row]
    assert flat == pytest.approx([(a - mean) / std for a in raw])
    assert got.returns == estimate_advantages(samples, plain, values=values).returns


@given(st.data(), grouped_samples(), st.sampled_from(ESTIMATORS))
def test_whitening_gives_mean_zero_unit_variance_over_response_tokens(
    data: st.DataObject, case: tuple[list[Sample], int], estimator: AdvantageEstimator
) -> None:
    samples, group_size = case
    spec = AdvantageSpec(estimator=estimator, group_size=group_size, gamma=0.9, lambd=0.95)
    values = rows_for(data, samples)
    plain = estimate_advantages(samples, spec, values=values)
    got = estimate_advantages(samples, attrs.evolve(spec, whiten=True), values=values)
    flat = [a for row in got.advantages for a in row]
    # What was whitened: GAE's advantages, or (no critic) the estimator's, which are the returns.
    raw = [a for row in (plain.advantages if estimator == "ppo" else plain.returns) for a in row]
    assert [len(r) for r in got.advantages] == [len(r) for r in plain.advantages]
    assert got.returns == plain.returns
    if estimator.startswith("reinforce_plus_plus"):  # whitened either way, once
        assert got == plain
    if not flat:
        return
    assert sum(flat) / len(flat) == pytest.approx(0.0, abs=1e-9)
    if len(raw) == 1:  # the one token is its own mean
        assert flat == [0.0]
        return
    mean = sum(raw) / len(raw)
    var = sum((a - mean) ** 2 for a in raw) / (len(raw) - 1)
    # Unbiased variance var / (var + 1e-8): 1 unless the 1e-8 matters.
    got_var = sum(a * a for a in flat) / (len(flat) - 1)
    assert got_var == pytest.approx(var / (var + 1e-8), rel=1e-6, abs=1e-9)


def test_estimate_names_what_is_missing_or_wrong() -> None:
    two = [sample(1.0, 2), sample(0.0, 1)]
    with pytest.raises(ValueError, match="'ppo' needs the critic's values"):
        estimate_advantages(two, AdvantageSpec(estimator="ppo", group_size=1))
    with pytest.raises(ValueError, match="needs log_probs"):
        estimate_advantages(two, AdvantageSpec(estimator="grpo", group_size=2, kl_coef=0.1))
    with pytest.raises(ValueError, match="needs ref_log_probs"):
        estimate_advantages(
            two,
            AdvantageSpec(estimator="grpo", group_size=2, kl_coef=0.1),
            log_probs=((0.0, 0.0), (0.0,)),
        )
    with pytest.raises(ValueError, match=r"values\[1\] has 2 entries but sample 1 has 1"):
        estimate_advantages(
            two, AdvantageSpec(estimator="ppo", group_size=1), values=((0.0, 0.0), (0.0, 0.0))
        )
    with pytest.raises(ValueError, match="values has 1 rows for 2 samples"):
        estimate_advantages(two, AdvantageSpec(estimator="ppo", group_size=1), values=((0.0, 0.0),))
    three = [*two, sample(1.0, 1)]
    with pytest.raises(ValueError, match="3 samples do not split into groups of 2"):
        estimate_advantages(three, AdvantageSpec(estimator="grpo", group_size=2))
    mixed = [sample(1.0, 1, group=0), sample(1.0, 1, group=1)]
    with pytest.raises(
        ValueError, match=r"samples 0..1 should form one group but carry group ids \[0, 1\]"
    ):
        estimate_advantages(
            mixed, AdvantageSpec(estimator="reinforce_plus_plus_baseline", group_size=2)
        )


def test_estimate_on_no_samples_and_on_empty_responses() -> None:
    for estimator in ESTIMATORS:
        spec = AdvantageSpec(estimator=estimator, group_size=2)
        assert estimate_advantages([], spec) == Advantages((), (), 0.0)
        empty = [sample(1.0, 0), sample(0.0, 0)]
        got = estimate_advantages(empty, spec, values=((), ()))
        assert got.advantages == ((), ()) and got.returns == ((), ())


@given(st.data(), grouped_samples(), st.sampled_from(ESTIMATORS), st.sampled_from([0.0, 0.05]))
def test_every_estimator_returns_one_row_per_response_token(
    data: st.DataObject,
    case: tuple[list[Sample], int],
    estimator: AdvantageEstimator,
    kl_coef: float,
) -> None:
    samples, group_size = case
    spec = AdvantageSpec(
        estimator=estimator, group_size=group_size, gamma=0.9, lambd=0.95, kl_coef=kl_coef
    )
    got = estimate_advantages(
        samples,
        spec,
        values=rows_for(data, samples),
        log_probs=tuple(s.response.log_probs for s in samples),
        ref_log_probs=rows_for(data, samples, st.floats(-8.0, 0.0)),
    )
    lengths = [len(s.response.token_ids) for s in samples]
    assert [len(r) for r in got.advantages] == lengths
    assert [len(r) for r in got.returns] == lengths
    assert all(math.isfinite(x) for row in got.advantages for x in row)
    if kl_coef == 0:
        assert got.kl == 0.0
    if estimator == "grpo":
        # Per-sequence advantages, constant along each response, summing to 0 over every group
        # whose samples all have tokens.
        for row in got.advantages:
            assert len(set(row)) <= 1
        for start in range(0, len(samples), group_size):
            rows = got.advantages[start : start + group_size]
            if all(rows):
                assert abs(sum(r[0] for r in rows)) < 1e-6 * (1 + sum(abs(r[0]) for r in rows))
