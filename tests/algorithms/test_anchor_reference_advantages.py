"""Advantage estimators and KL estimators against the anchors' published formulas (#34).

Each reference below is written here, in plain float64 Python over lists, from the formulas in
slime (``slime/utils/ppo_utils.py``, ``slime/backends/megatron_utils/loss.py``,
``slime/utils/distributed_utils.py``, ``slime/ray/rollout.py``) and verl
(``verl/trainer/ppo/core_algos.py``, ``verl/utils/torch_functional.py``), read, not copied. Where
the anchors disagree with each other or with us on purpose (README, "Algorithms", the table of
differences), the reference follows the convention named in its docstring. Inputs are random,
right-padded, with multi-turn loss masks (model tokens and environment tokens in any order).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.advantages import (
    estimate_advantages,
    gae,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from rlcore.algorithms.kl import kl_estimate
from rlcore.samples import Generation, Prompt, Sample
from rlcore.specs import AdvantageEstimator, AdvantageSpec, KLType
from tests.strategies import ESTIMATORS, KL_TYPES, padded_episodes, tensor_like

Rows = list[list[float]]
Mask = list[list[bool]]


def _rows(x: torch.Tensor) -> Rows:
    return [[float(v) for v in row] for row in x.tolist()]


def _mask(m: torch.Tensor) -> Mask:
    return [[bool(v) for v in row] for row in m.tolist()]


# --- references ----------------------------------------------------------------------------------


def ref_group_advantages(rewards: list[float], n: int, how: str) -> list[float]:
    """Per group of ``n`` consecutive scores. ``grpo``: ``(r - mean) / (std + 1e-6)``, ``std``
    with Bessel's correction (slime's ``_post_process_rewards``, verl's
    ``compute_grpo_outcome_advantage``); ``dr_grpo``: ``r - mean`` (both, without the std);
    ``rloo``: ``r_i`` minus the mean of the group's other scores (verl's
    ``compute_rloo_outcome_advantage``: ``(n r_i - sum) / (n - 1)``). A group of one scores 0
    (slime: ``r - mean``; verl gives ``grpo`` the raw score there)."""
    out: list[float] = []
    for start in range(0, len(rewards), n):
        group = rewards[start : start + n]
        if n == 1:
            out.append(0.0)
            continue
        mean = math.fsum(group) / n
        if how == "rloo":
            out += [r - (math.fsum(group) - r) / (n - 1) for r in group]
        elif how == "dr_grpo":
            out += [r - mean for r in group]
        else:
            std = math.sqrt(math.fsum((r - mean) ** 2 for r in group) / (n - 1))
            out += [(r - mean) / (std + 1e-6) for r in group]
    return out


def ref_whiten(x: Rows, mask: Mask) -> Rows:
    """slime's ``distributed_masked_whiten`` / verl's ``masked_whiten``: mean and variance over
    the masked entries, the variance times ``n / (n - 1)`` (slime: when ``n >= 2``), then
    ``(x - mean) / sqrt(var + 1e-8)``. Unmasked entries read 0 (ours; the anchors leave a value
    the loss masks out). ``n = 0``: all 0 (both anchors raise)."""
    kept = [
        v for row, mrow in zip(x, mask, strict=True) for v, m in zip(row, mrow, strict=True) if m
    ]
    n = len(kept)
    if n == 0:
        return [[0.0] * len(row) for row in x]
    mean = math.fsum(kept) / n
    var = math.fsum((v - mean) ** 2 for v in kept) / n
    if n >= 2:
        var *= n / (n - 1)
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [
        [(v - mean) * scale if m else 0.0 for v, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(x, mask, strict=True)
    ]


def ref_gae(
    rewards: Rows, values: Rows, mask: Mask, gamma: float, lambd: float
) -> tuple[Rows, Rows]:
    """verl's ``compute_gae_advantage_return`` with its multi-turn rule (values and TD errors of
    observation tokens skipped: the carried ``nextvalues`` and ``lastgaelam`` pass over them);
    returns ``A + V``. Compared on model tokens only (verl leaves the carried value elsewhere)."""
    adv_rows, ret_rows = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
        next_value = last = 0.0
        adv = [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            delta = r_row[t] + gamma * next_value - v_row[t]
            here = delta + gamma * lambd * last
            if m_row[t]:
                next_value, last = v_row[t], here
            adv[t] = last
        adv_rows.append(adv)
        ret_rows.append([a + v for a, v in zip(adv, v_row, strict=True)])
    return adv_rows, ret_rows


def ref_vanilla_gae(
    rewards: list[float], values: list[float], gamma: float, lambd: float
) -> list[float]:
    """slime's ``vanilla_gae`` over one response, every token a step (single turn):
    ``A_t = sum_k (gamma lambd)^k delta_{t+k}``, ``delta_t = r_t + gamma V_{t+1} - V_t``, ``V`` 0
    after the end."""
    n = len(rewards)
    deltas = [
        rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)
    ]
    return [
        math.fsum((gamma * lambd) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)
    ]


def ref_discounted_returns(rewards: Rows, mask: Mask, gamma: float) -> Rows:
    """REINFORCE++'s ``G_t = sum_{k >= t} gamma^(k - t) r_k`` (Hu 2025; slime's
    ``get_reinforce_plus_plus_returns``, verl's ``compute_reinforce_plus_plus_outcome_advantage``),
    with ``k - t`` counted in model tokens and only model tokens summed: our multi-turn rule
    (slime steps over observation tokens, verl restarts there). 0 off the mask."""
    out = []
    for r_row, m_row in zip(rewards, mask, strict=True):
        steps = [t for t, m in enumerate(m_row) if m]
        row = [0.0] * len(r_row)
        for j, t in enumerate(steps):
            row[t] = math.fsum(gamma ** (i - j) * r_row[steps[i]] for i in range(j, len(steps)))
        out.append(row)
    return out


def ref_kl(logp: float, ref: float, kind: str) -> float:
    """slime's ``compute_approx_kl`` / verl's ``kl_penalty_forward`` with ``log r = ref - logp``:
    k1 ``logp - ref``; k2 ``(logp - ref)^2 / 2``; k3 ``exp(log r) - 1 - log r`` (slime; verl's
    ``k3`` is its ``low_var_kl``); low_var_kl: k3 of ``log r`` clamped to ``[-20, 20]``, then
    clamped to ``[-10, 10]`` (verl; slime clamps the result only, the same value)."""
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    log_r = ref - logp
    if kind == "low_var_kl":
        log_r = min(max(log_r, -20.0), 20.0)
        return min(max(math.exp(log_r) - 1.0 - log_r, -10.0), 10.0)
    return math.exp(log_r) - 1.0 - log_r


# --- group estimators ----------------------------------------------------------------------------

groups = st.integers(1, 5).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.integers(1, 4).flatmap(
            lambda g: st.lists(
                st.floats(-3.0, 3.0, allow_nan=False), min_size=g * n, max_size=g * n
            )
        ),
    )
)


@given(groups, st.sampled_from(["grpo", "dr_grpo", "rloo"]))
def test_grpo_dr_grpo_and_rloo_are_the_anchors_formulas(
    case: tuple[int, list[float]], how: str
) -> None:
    n, rewards = case
    r = torch.tensor(rewards, dtype=torch.float64)
    if how == "rloo":
        got = rloo_advantages(r, n)
    else:
        got = grpo_advantages(r, n, normalize_std=how == "grpo")
    assert got.tolist() == pytest.approx(ref_group_advantages(rewards, n, how), rel=1e-9, abs=1e-9)


# --- whitening, GAE, REINFORCE++ -----------------------------------------------------------------


@given(st.data(), padded_episodes(), st.integers(1, 3))
def test_reinforce_plus_plus_baseline_is_the_centred_score_whitened(
    data: st.DataObject, episodes: tuple[torch.Tensor, torch.Tensor], n: int
) -> None:
    """verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``: score minus the group
    mean on every model token, then ``masked_whiten`` (Bessel); groups of ``n`` rows."""
    _, mask = episodes
    rows = int(mask.shape[0]) // n * n
    mask = mask[:rows]
    if rows == 0:
        return
    scores = data.draw(st.lists(st.floats(-3.0, 3.0), min_size=rows, max_size=rows))
    got = reinforce_plus_plus_baseline_advantages(
        torch.tensor(scores, dtype=torch.float64), n, mask
    )
    centred = ref_group_advantages(scores, n, "dr_grpo")
    m = _mask(mask)
    broadcast = [[c if k else 0.0 for k in row] for c, row in zip(centred, m, strict=True)]
    want = ref_whiten(broadcast, m)
    for g_row, w_row in zip(_rows(got), want, strict=True):
        assert g_row == pytest.approx(w_row, rel=1e-9, abs=1e-9)


@given(st.data(), padded_episodes(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_gae_is_verls_masked_recursion_and_slimes_on_a_single_turn(
    data: st.DataObject, episodes: tuple[torch.Tensor, torch.Tensor], gamma: float, lambd: float
) -> None:
    response, mask = episodes
    rewards, values = tensor_like(data, mask, -2.0, 2.0), tensor_like(data, mask, -2.0, 2.0)
    adv, ret = gae(rewards, values, mask, gamma, lambd)
    m = _mask(mask)
    want_adv, want_ret = ref_gae(_rows(rewards), _rows(values), m, gamma, lambd)
    for i, m_row in enumerate(m):
        for t, k in enumerate(m_row):
            if k:
                assert float(adv[i, t]) == pytest.approx(want_adv[i][t], rel=1e-9, abs=1e-9)
                assert float(ret[i, t]) == pytest.approx(want_ret[i][t], rel=1e-9, abs=1e-9)
            else:
                assert float(adv[i, t]) == float(ret[i, t]) == 0.0
        if m_row == _mask(response)[i]:  # a single turn: slime's GAE over the whole response
            n = sum(m_row)
            slime = ref_vanilla_gae(_rows(rewards)[i][:n], _rows(values)[i][:n], gamma, lambd)
            assert adv[i, :n].tolist() == pytest.approx(slime, rel=1e-9, abs=1e-9)


@given(st.data(), padded_episodes(), st.floats(0.0, 1.0))
def test_reinforce_plus_plus_is_the_discounted_return_whitened(
    data: st.DataObject, episodes: tuple[torch.Tensor, torch.Tensor], gamma: float
) -> None:
    _, mask = episodes
    rewards = tensor_like(data, mask, -2.0, 2.0)
    got = reinforce_plus_plus_advantages(rewards, mask, gamma)
    m = _mask(mask)
    want = ref_whiten(ref_discounted_returns(_rows(rewards), m, gamma), m)
    for g_row, w_row in zip(_rows(got), want, strict=True):
        assert g_row == pytest.approx(w_row, rel=1e-9, abs=1e-9)


# --- KL estimators -------------------------------------------------------------------------------


@given(st.data(), padded_episodes(), st.sampled_from(KL_TYPES))
def test_kl_estimators_are_slimes_and_verls(
    data: st.DataObject, episodes: tuple[torch.Tensor, torch.Tensor], kind: KLType
) -> None:
    _, mask = episodes
    logp, ref = tensor_like(data, mask, -30.0, 0.0), tensor_like(data, mask, -30.0, 0.0)
    got = kl_estimate(logp, ref, kind)
    for g_row, l_row, r_row in zip(_rows(got), _rows(logp), _rows(ref), strict=True):
        want = [ref_kl(lp, rf, kind) for lp, rf in zip(l_row, r_row, strict=True)]
        assert g_row == pytest.approx(want, rel=1e-9, abs=1e-12)


# --- the whole estimate, on episodes -------------------------------------------------------------


def _episodes(
    data: st.DataObject, episodes: tuple[torch.Tensor, torch.Tensor], n: int
) -> list[Sample]:
    response, mask = episodes
    out = []
    for i in range(int(response.shape[0]) // n * n):
        length = int(response[i].sum())
        loss_mask = tuple(int(v) for v in mask[i, :length].tolist())
        out.append(
            Sample(
                prompt=Prompt(index=i // n, text="", token_ids=(1,)),
                response=Generation(
                    token_ids=(3,) * length,
                    log_probs=tuple(
                        data.draw(st.lists(st.floats(-5.0, 0.0), min_size=length, max_size=length))
                    ),
                    text="",
                    loss_mask=loss_mask if 0 in loss_mask else (),
                ),
                reward=data.draw(st.floats(-2.0, 2.0)),
                group=i // n,
            )
        )
    return out


@given(
    st.data(),
    padded_episodes(),
    st.integers(1, 2),
    st.sampled_from(ESTIMATORS),
    st.sampled_from([0.0, 0.3]),
    st.booleans(),
)
def test_estimate_advantages_follows_the_anchors_pipeline(
    data: st.DataObject,
    episodes: tuple[torch.Tensor, torch.Tensor],
    n: int,
    estimator: AdvantageEstimator,
    kl_coef: float,
    whiten: bool,
) -> None:
    """verl's order of things: the reward on the last model token, ``-kl_coef * k1`` on every
    model token (``compute_rewards``), grouped estimators on the summed token rewards (their
    ``scores``), GAE / REINFORCE++ on the token rewards; then an added per-token term (OPD) and
    whitening (asked for, or REINFORCE++'s), in slime's ``compute_advantages_and_returns`` order.
    Returns are the estimator's, before either."""
    samples = _episodes(data, episodes, n)
    if not samples:
        return
    lengths = [len(s.response.token_ids) for s in samples]
    m = [list(map(bool, s.response.model_mask)) for s in samples]
    logp = [s.response.log_probs for s in samples]
    ref = [
        tuple(data.draw(st.lists(st.floats(-5.0, 0.0), min_size=k, max_size=k))) for k in lengths
    ]
    values = [
        tuple(data.draw(st.lists(st.floats(-2.0, 2.0), min_size=k, max_size=k))) for k in lengths
    ]
    terms = [
        tuple(data.draw(st.lists(st.floats(-1.0, 1.0), min_size=k, max_size=k))) for k in lengths
    ]
    spec = AdvantageSpec(estimator, n, gamma=0.9, lambd=0.8, kl_coef=kl_coef, whiten=whiten)
    got = estimate_advantages(
        samples, spec, values=values, log_probs=logp, ref_log_probs=ref, token_terms=terms
    )

    token_rewards: Rows = []
    for s, m_row, l_row, r_row in zip(samples, m, logp, ref, strict=True):
        row = [
            -kl_coef * ref_kl(lp, rf, "k1") if k else 0.0
            for lp, rf, k in zip(l_row, r_row, m_row, strict=True)
        ]
        if any(m_row):
            row[max(t for t, k in enumerate(m_row) if k)] += s.reward
        token_rewards.append(row)
    scores = [
        math.fsum(row) if any(k) else s.reward
        for row, k, s in zip(token_rewards, m, samples, strict=True)
    ]
    if estimator in ("grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"):
        how = {"grpo": "grpo", "gspo": "grpo", "rloo": "rloo"}.get(estimator, "dr_grpo")
        per_seq = ref_group_advantages(scores, n, how)
        base = [[a if k else 0.0 for k in m_row] for a, m_row in zip(per_seq, m, strict=True)]
        returns = base
    elif estimator == "reinforce_plus_plus":
        base = returns = ref_discounted_returns(token_rewards, m, 0.9)
    else:
        base, returns = ref_gae(token_rewards, [list(v) for v in values], m, 0.9, 0.8)
        base = [
            [a if k else 0.0 for a, k in zip(row, m_row, strict=True)]
            for row, m_row in zip(base, m, strict=True)
        ]
        returns = [
            [a if k else 0.0 for a, k in zip(row, m_row, strict=True)]
            for row, m_row in zip(returns, m, strict=True)
        ]
    summed = [
        [a + (t if k else 0.0) for a, t, k in zip(row, t_row, m_row, strict=True)]
        for row, t_row, m_row in zip(base, terms, m, strict=True)
    ]
    want = (
        ref_whiten(summed, m) if whiten or estimator.startswith("reinforce_plus_plus") else summed
    )
    for g_row, w_row, r_row, want_ret in zip(
        got.advantages, want, got.returns, returns, strict=True
    ):
        assert list(g_row) == pytest.approx(w_row, rel=1e-9, abs=1e-8)
        assert list(r_row) == pytest.approx(want_ret, rel=1e-9, abs=1e-8)


def test_the_kl_penalty_enters_the_grouped_scores_summed_as_verl_has_it() -> None:
    """Where the anchors part: verl's grouped estimators compare the summed token rewards, KL
    penalty included; slime's GRPO ignores ``--kl-coef`` (the reward alone). Ours is verl's."""
    samples = [
        Sample(Prompt(0, "", (1,)), Generation((3, 3), (-1.0, -1.0), ""), reward=1.0, group=0),
        Sample(Prompt(0, "", (1,)), Generation((3,), (-1.0,), ""), reward=1.0, group=0),
    ]
    spec = AdvantageSpec("rloo", 2, kl_coef=0.5)
    got = estimate_advantages(
        samples, spec, log_probs=((-1.0, -1.0), (-1.0,)), ref_log_probs=((-2.0, -2.0), (-2.0,))
    )
    # k1 = 1 per token: scores 1 - 0.5 * 2 = 0 and 1 - 0.5 = 0.5; leave-one-out: -0.5, 0.5.
    assert got.advantages == ((-0.5, -0.5), (0.5,))
