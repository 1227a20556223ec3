"""Policy loss, corrections, aggregation and the whole actor loss with its gradient, against the
anchors' published formulas (#34).

The references are written here from slime's ``compute_policy_loss`` (``ppo_utils.py``), its
``vanilla_tis_function`` / ``icepop_function`` / ``examples/train_infer_mismatch_helper/mis.py``
(``loss.py``) and verl's ``compute_policy_loss_vanilla``, ``compute_policy_loss_gspo``,
``agg_loss``, ``compute_value_loss`` and ``kl_penalty`` (``core_algos.py``): read, not copied.
The actor loss's reference is built token by token from 0-d float64 tensors, so its gradient is
torch.autograd's through an independent computation. Inputs are random, right-padded, with
multi-turn loss masks; rows without a model token are kept (counted as sequences: README).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.correction import importance_weights
from rlcore.algorithms.losses import (
    actor_loss,
    aggregate,
    loss_normalizer,
    policy_loss,
    value_loss,
)
from rlcore.specs import ISCorrection, KLType, LossAggMode, LossSpec, RatioLevel
from tests.algorithms.test_loss_mask import batch as padded_batch
from tests.strategies import KL_TYPES, padded_episodes, tensor_like

MODES: tuple[LossAggMode, ...] = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-budget")
Episodes = tuple[torch.Tensor, torch.Tensor]


# --- references ----------------------------------------------------------------------------------


def ref_aggregate(per_token: list[list[float]], mask: list[list[bool]], mode: str, c: int) -> float:
    """The global batch's value. ``token-mean``: verl's ``masked_sum / batch_num_tokens`` (slime's
    per-token loss). ``seq-mean-token-mean``: each row's token mean (``n_i`` clamped to 1, slime's
    ``sum_of_sample_mean``), averaged over all ``B`` rows (slime's global batch size; verl leaves
    rows without tokens out of the count). ``seq-mean-token-sum-budget``: each row's token sum
    over ``C``, averaged over ``B`` (Dr. GRPO; verl's ``seq-mean-token-sum-norm`` sums rows)."""
    sums = [
        math.fsum(v for v, k in zip(row, mrow, strict=True) if k)
        for row, mrow in zip(per_token, mask, strict=True)
    ]
    counts = [sum(mrow) for mrow in mask]
    if mode == "token-mean":
        return math.fsum(sums) / max(sum(counts), 1)
    if mode == "seq-mean-token-mean":
        return math.fsum(s / max(n, 1) for s, n in zip(sums, counts, strict=True)) / len(mask)
    return math.fsum(sums) / c / len(mask)


def ref_ppo_token(
    ratio: float, a: float, lo: float, hi: float, c: float | None
) -> tuple[float, bool, bool]:
    """verl's ``compute_policy_loss_vanilla`` / slime's ``compute_policy_loss`` for one token:
    ``pg1 = -A r``, ``pg2 = -A clip(r, 1 - lo, 1 + hi)``, loss ``max(pg1, pg2)``; with the dual
    clip, for ``A < 0``, ``min(max(pg1, pg2), -c A)``. Returns (loss, PPO-clipped: ``pg2 > pg1``,
    held at the dual bound: verl's ``pg_clipfrac_lower`` indicator)."""
    pg1 = -a * ratio
    pg2 = -a * min(max(ratio, 1.0 - lo), 1.0 + hi)
    loss = max(pg1, pg2)
    dual = c is not None and a < 0 and loss > -c * a
    if dual:
        assert c is not None
        loss = -c * a
    return loss, pg2 > pg1, dual


def ref_ratios(
    logp: list[list[float]], old: list[list[float]], mask: list[list[bool]], level: str
) -> list[list[float]]:
    """``exp(logp - old)`` per token, or GSPO's ``s_i = exp(mean_t (logp - old))`` over the row's
    model tokens (verl's ``compute_policy_loss_gspo``, slime's ``compute_gspo_kl``)."""
    out = []
    for l_row, o_row, m_row in zip(logp, old, mask, strict=True):
        if level == "sequence":
            diffs = [lp - o for lp, o, k in zip(l_row, o_row, m_row, strict=True) if k]
            s = math.exp(math.fsum(diffs) / max(len(diffs), 1))
            out.append([s] * len(l_row))
        else:
            out.append([math.exp(lp - o) for lp, o in zip(l_row, o_row, strict=True)])
    return out


def ref_is_weights(
    train: list[list[float]], rollout: list[list[float]], mask: list[list[bool]], spec: ISCorrection
) -> list[list[float]]:
    """slime's TIS (``clamp(r, low, high)``) and IcePop (``r`` inside ``[low, high]``, else 0) on
    ``r = exp(train - rollout)``; the geometric level's one ratio per row, ``exp`` of the mean log
    ratio over model tokens, and the veto (any model token's ratio below the threshold zeroes its
    row), as slime's ``mis.py`` example has them. 0 off the mask."""
    out = []
    for t_row, r_row, m_row in zip(train, rollout, mask, strict=True):
        logs = [t - r for t, r in zip(t_row, r_row, strict=True)]
        if spec.level == "geometric":
            kept = [x for x, k in zip(logs, m_row, strict=True) if k]
            logs = [math.fsum(kept) / max(len(kept), 1)] * len(logs)
        ratios = [math.exp(x) for x in logs]
        if spec.mode == "clip":
            w = [min(max(r, spec.low), spec.high) for r in ratios]
        else:
            w = [r if spec.low <= r <= spec.high else 0.0 for r in ratios]
        threshold = spec.veto_threshold
        if threshold is not None and any(
            math.exp(t - r) < threshold for t, r, k in zip(t_row, r_row, m_row, strict=True) if k
        ):
            w = [0.0] * len(w)
        out.append([x if k else 0.0 for x, k in zip(w, m_row, strict=True)])
    return out


def _rows(x: torch.Tensor) -> list[list[float]]:
    return [[float(v) for v in row] for row in x.tolist()]


def _mask(m: torch.Tensor) -> list[list[bool]]:
    return [[bool(v) for v in row] for row in m.tolist()]


corrections = st.builds(
    ISCorrection,
    mode=st.sampled_from(["clip", "mask"]),
    level=st.sampled_from(["token", "geometric"]),
    low=st.sampled_from([0.0, 0.5, 0.8]),
    high=st.sampled_from([1.2, 2.0]),
    veto_threshold=st.sampled_from([None, 0.3]),
)


# --- aggregation, policy loss, corrections, value loss -------------------------------------------


@given(st.data(), padded_episodes(), st.sampled_from(MODES), st.integers(1, 8))
def test_each_aggregation_mode_over_the_global_batch(
    data: st.DataObject, episodes: Episodes, mode: LossAggMode, c: int
) -> None:
    _, mask = episodes
    x = tensor_like(data, mask, -3.0, 3.0)
    got = float(aggregate(x, mask, mode, c)) / loss_normalizer(mode, mask)
    assert got == pytest.approx(ref_aggregate(_rows(x), _mask(mask), mode, c), rel=1e-9, abs=1e-12)
    if all(mask.any(dim=1).tolist()):  # no empty row: verl's agg_loss over one micro-batch
        m, rows, b = _mask(mask), _rows(x), int(mask.shape[0])
        token_sums = [
            math.fsum(v for v, k in zip(r, mr, strict=True) if k)
            for r, mr in zip(rows, m, strict=True)
        ]
        verl = {
            "token-mean": math.fsum(token_sums) / sum(map(sum, m)),
            "seq-mean-token-mean": math.fsum(
                s / sum(mr) for s, mr in zip(token_sums, m, strict=True)
            )
            / b,
            "seq-mean-token-sum-budget": math.fsum(token_sums) / c / b,  # verl's -norm over B
        }[mode]
        assert got == pytest.approx(verl, rel=1e-9, abs=1e-12)


@given(
    st.data(),
    padded_episodes(),
    st.sampled_from(["token", "sequence"]),
    st.floats(0.05, 0.3),
    st.floats(0.05, 0.4),
    st.one_of(st.none(), st.floats(1.1, 3.0)),
)
def test_ppo_clip_clip_higher_dual_clip_and_gspos_ratio(
    data: st.DataObject,
    episodes: Episodes,
    level: RatioLevel,
    lo: float,
    hi: float,
    c: float | None,
) -> None:
    _, mask = episodes
    old = tensor_like(data, mask, -4.0, 0.0)
    logp = old + tensor_like(data, mask, -1.5, 2.0)
    adv = tensor_like(data, mask, -3.0, 3.0)
    out = policy_loss(
        logp, old, adv, mask, lo, hi, eps_clip_c=c, ratio_level=level, agg_mode="token-mean"
    )
    m = _mask(mask)
    ratios = ref_ratios(_rows(logp), _rows(old), m, level)
    per, clipped, dual = [], [], []
    for r_row, a_row, m_row in zip(ratios, _rows(adv), m, strict=True):
        row = [ref_ppo_token(r, a, lo, hi, c) for r, a in zip(r_row, a_row, strict=True)]
        per.append([x[0] for x in row])
        clipped += [x[1] for x, k in zip(row, m_row, strict=True) if k]
        dual += [x[2] for x, k in zip(row, m_row, strict=True) if k]
    n = max(len(clipped), 1)
    got = _f(out.loss) / loss_normalizer("token-mean", mask)
    assert got == pytest.approx(ref_aggregate(per, m, "token-mean", 1), rel=1e-9, abs=1e-12)
    assert float(out.clipfrac) == pytest.approx(sum(clipped) / n)  # verl's pg_clipfrac
    assert float(out.dual_clipfrac) == pytest.approx(sum(dual) / n)  # verl's pg_clipfrac_lower


@given(st.data(), padded_episodes(), corrections)
def test_tis_icepop_geometric_and_veto_weights(
    data: st.DataObject, episodes: Episodes, spec: ISCorrection
) -> None:
    _, mask = episodes
    train = tensor_like(data, mask, -4.0, 0.0)
    rollout = train + tensor_like(data, mask, -1.5, 1.5)
    got = importance_weights(train, rollout, mask, spec)
    want = ref_is_weights(_rows(train), _rows(rollout), _mask(mask), spec)
    for g_row, w_row in zip(_rows(got.weights), want, strict=True):
        assert g_row == pytest.approx(w_row, rel=1e-9, abs=1e-12)
    kept = [
        w
        for row, m_row in zip(want, _mask(mask), strict=True)
        for w, k in zip(row, m_row, strict=True)
        if k
    ]
    assert got.metrics["tis_weight"] == pytest.approx(math.fsum(kept) / max(len(kept), 1))


@given(st.data(), padded_episodes(), st.sampled_from(MODES), st.floats(0.05, 0.5), st.booleans())
def test_value_loss_is_verls_with_its_half(
    data: st.DataObject, episodes: Episodes, mode: LossAggMode, clip: float, clipped: bool
) -> None:
    """verl's ``compute_value_loss``: ``0.5 * max((v - R)^2, (old + clip(v - old) - R)^2)``
    (slime's ``value_loss_function`` has no 0.5: README, "Algorithms")."""
    _, mask = episodes
    v, old, ret = (tensor_like(data, mask, -2.0, 2.0) for _ in range(3))
    got = value_loss(v, old if clipped else None, ret, mask, clip, agg_mode=mode, agg_constant=3)
    per = []
    for v_row, o_row, r_row in zip(_rows(v), _rows(old), _rows(ret), strict=True):
        row = []
        for vv, o, r in zip(v_row, o_row, r_row, strict=True):
            vc = o + min(max(vv - o, -clip), clip)
            row.append(0.5 * (max((vv - r) ** 2, (vc - r) ** 2) if clipped else (vv - r) ** 2))
        per.append(row)
    want = ref_aggregate(per, _mask(mask), mode, 3)
    assert float(got) / loss_normalizer(mode, mask) == pytest.approx(want, rel=1e-9, abs=1e-12)


# --- the whole actor loss, value and gradient ----------------------------------------------------


def _f(x: torch.Tensor) -> float:
    """A 0-d tensor's value, to pick a branch (not a path for gradients)."""
    return float(x.detach())


def ref_kl_torch(lp: torch.Tensor, ref: float, kind: str) -> torch.Tensor:
    """:func:`ref_kl`'s estimators on a 0-d tensor, for autograd (clamped pieces are constants)."""
    if kind == "k1":
        return lp - ref
    if kind == "k2":
        return 0.5 * (lp - ref) ** 2
    log_r = ref - lp
    if kind == "low_var_kl" and abs(_f(log_r)) > 20.0:
        log_r = torch.tensor(math.copysign(20.0, _f(log_r)), dtype=torch.float64)
    k = torch.exp(log_r) - 1.0 - log_r
    if kind == "low_var_kl" and _f(k) > 10.0:
        return torch.tensor(10.0, dtype=torch.float64)
    return k


def ref_actor_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    old: list[list[float]],
    ref: list[list[float]],
    adv: list[list[float]],
    weights: list[list[float]] | None,
    mask: list[list[bool]],
    spec: LossSpec,
) -> torch.Tensor:
    """``policy loss + kl_loss_coef * KL loss - entropy_coef * entropy`` (verl's ``dp_actor`` and
    slime's ``policy_loss_function``), each term aggregated as ``spec.agg_mode`` says, built token
    by token; branches are picked by value, so autograd differentiates the active one."""
    b = len(mask)
    terms: list[list[torch.Tensor]] = []
    for i in range(b):
        if spec.ratio_level == "sequence":
            kept = [logp[i, t] - old[i][t] for t in range(len(mask[i])) if mask[i][t]]
            seq_ratio = torch.exp(
                sum(kept, torch.zeros((), dtype=torch.float64)) / max(len(kept), 1)
            )
        row = []
        for t in range(len(mask[i])):
            ratio = (
                seq_ratio if spec.ratio_level == "sequence" else torch.exp(logp[i, t] - old[i][t])
            )
            a = adv[i][t]
            pg1 = -a * ratio
            r = _f(ratio)
            inside = 1.0 - spec.eps_clip <= r <= 1.0 + spec.eps_clip_high
            pg2 = (
                pg1
                if inside
                else torch.tensor(
                    -a * min(max(r, 1.0 - spec.eps_clip), 1.0 + spec.eps_clip_high),
                    dtype=torch.float64,
                )
            )
            pg = pg2 if _f(pg2) > _f(pg1) else pg1
            c = spec.eps_clip_c
            if c is not None and a < 0 and _f(pg) > -c * a:
                pg = torch.tensor(-c * a, dtype=torch.float64)
            if weights is not None:
                pg = pg * weights[i][t]
            term = pg
            if spec.use_kl_loss:
                term = term + spec.kl_loss_coef * ref_kl_torch(
                    logp[i, t], ref[i][t], spec.kl_loss_type
                )
            term = term - spec.entropy_coef * entropy[i, t]
            row.append(term)
        terms.append(row)
    zero = torch.zeros((), dtype=torch.float64)
    sums = [
        sum((x for x, k in zip(row, m_row, strict=True) if k), zero)
        for row, m_row in zip(terms, mask, strict=True)
    ]
    counts = [sum(m_row) for m_row in mask]
    if spec.agg_mode == "token-mean":
        return sum(sums, zero) / max(sum(counts), 1)
    if spec.agg_mode == "seq-mean-token-mean":
        return sum((s / max(n, 1) for s, n in zip(sums, counts, strict=True)), zero) / b
    return sum(sums, zero) / spec.agg_constant / b


@given(
    st.data(),
    padded_episodes(max_b=3, max_t=5),
    st.sampled_from(MODES),
    st.sampled_from(["token", "sequence"]),
    st.one_of(st.none(), st.floats(1.1, 3.0)),
    st.one_of(st.none(), st.sampled_from(KL_TYPES)),
    st.one_of(st.none(), corrections),
)
def test_the_actor_loss_and_its_gradient(
    data: st.DataObject,
    episodes: Episodes,
    mode: LossAggMode,
    level: RatioLevel,
    c: float | None,
    kl: KLType | None,
    correction: ISCorrection | None,
) -> None:
    _, mask = episodes
    spec = LossSpec(
        eps_clip=data.draw(st.floats(0.05, 0.3)),
        eps_clip_high=data.draw(st.floats(0.05, 0.4)),
        eps_clip_c=c,
        entropy_coef=data.draw(st.sampled_from([0.0, 0.01])),
        use_kl_loss=kl is not None,
        kl_loss_coef=0.1 if kl is not None else 0.0,
        kl_loss_type=kl or "low_var_kl",
        agg_mode=mode,
        agg_constant=data.draw(st.integers(1, 6)),
        ratio_level=level,
        correction=correction,
    )
    old = tensor_like(data, mask, -4.0, 0.0)
    logp = (old + tensor_like(data, mask, -1.5, 2.0)).requires_grad_()
    ref = tensor_like(data, mask, -4.0, 0.0)
    rollout = old + tensor_like(data, mask, -1.0, 1.0)
    adv = tensor_like(data, mask, -3.0, 3.0)
    entropy = tensor_like(data, mask, 0.0, 3.0).requires_grad_()
    response, _ = episodes
    fields = {"old_log_probs": old, "ref_log_probs": ref, "rollout_log_probs": rollout}
    batch = padded_batch(mask, response, advantages=adv, **fields)
    out = actor_loss(logp, batch, spec, entropy)
    got = out.loss / loss_normalizer(mode, mask)
    m = _mask(mask)
    weights = (
        None if correction is None else ref_is_weights(_rows(old), _rows(rollout), m, correction)
    )
    want = ref_actor_loss(logp, entropy, _rows(old), _rows(ref), _rows(adv), weights, m, spec)
    assert _f(got) == pytest.approx(_f(want), rel=1e-9, abs=1e-12)
    if not want.requires_grad:  # no model token anywhere: nothing to differentiate
        return
    grads = torch.autograd.grad(got, (logp, entropy), allow_unused=True)
    want_grads = torch.autograd.grad(want, (logp, entropy), allow_unused=True)
    for g, w in zip(grads, want_grads, strict=True):
        g = torch.zeros_like(logp) if g is None else g
        w = torch.zeros_like(logp) if w is None else w
        assert torch.allclose(g, w, rtol=1e-9, atol=1e-12), (g, w)
