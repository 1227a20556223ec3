"""On-policy distillation's advantage term ``-coef * (student_t - teacher_t)``, and OPD through
``estimate_advantages``: the term is added after the estimator, before any whitening (slime)."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.advantages import estimate_advantages
from rlcore.algorithms.distill import distillation_advantages
from rlcore.samples import Generation, Prompt, Sample
from rlcore.specs import AdvantageEstimator, AdvantageSpec
from tests.strategies import ESTIMATORS, grouped_samples, rows_for

LOGP = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)
ADV = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False)
COEF = st.floats(min_value=0.0, max_value=5.0)
Rows = list[tuple[float, ...]]
Drawn = tuple[Rows, Rows, Rows, list[tuple[int, ...]]]


@st.composite
def rollouts(draw: st.DrawFn) -> Drawn:
    lengths = draw(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=5))

    def rows(values: st.SearchStrategy[float]) -> list[tuple[float, ...]]:
        return [tuple(draw(st.lists(values, min_size=n, max_size=n))) for n in lengths]

    masks = [tuple(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))) for n in lengths]
    return rows(ADV), rows(LOGP), rows(LOGP), masks


@given(rollouts(), st.floats(min_value=0.0, max_value=5.0))
def test_each_token_gets_minus_coef_times_its_reverse_kl_estimate(
    drawn: Drawn, coef: float
) -> None:
    """The term OPD adds (and --opd-only's advantage); the metrics average over trained tokens."""
    _, student, teacher, masks = drawn
    out = distillation_advantages(student, teacher, coef, masks)
    assert out.advantages == tuple(
        tuple(-coef * (s - t) for s, t in zip(s_row, t_row, strict=True))
        for s_row, t_row in zip(student, teacher, strict=True)
    )
    # The metrics average over the trained tokens only (a zero in the mask is an observation).
    trained = [
        (s, t)
        for s_row, t_row, m_row in zip(student, teacher, masks, strict=True)
        for s, t, m in zip(s_row, t_row, m_row, strict=True)
        if m
    ]
    if trained:
        assert math.isclose(
            out.kl_mean, sum(s - t for s, t in trained) / len(trained), abs_tol=1e-9
        )
        assert math.isclose(
            out.teacher_logprob_mean, sum(t for _, t in trained) / len(trained), abs_tol=1e-9
        )
    else:
        assert out.kl_mean == out.teacher_logprob_mean == 0.0


def test_a_teacher_likelier_than_the_student_raises_the_advantage() -> None:
    out = distillation_advantages([(-2.0, -0.5)], [(-0.5, -2.0)], coef=1.0)
    assert out.advantages == ((1.5, -1.5),)
    assert out.kl_mean == 0.0 and out.teacher_logprob_mean == -1.25
    # A sample's empty loss mask means every token is trained, as in Generation.loss_mask.
    assert distillation_advantages([(-2.0, -0.5)], [(-0.5, -2.0)], 1.0, [()]) == out


# --- OPD on top of an estimator: added after it, before any whitening (slime's order) ----------


def _opd_terms(data: st.DataObject, batch: list[Sample], coef: float) -> Rows:
    student = rows_for(data, batch, LOGP)
    teacher = rows_for(data, batch, LOGP)
    return list(distillation_advantages(student, teacher, coef).advantages)


@given(st.data(), grouped_samples(), st.sampled_from(ESTIMATORS), st.booleans())
def test_coefficient_zero_is_the_base_estimator(
    data: st.DataObject, case: tuple[list[Sample], int], estimator: AdvantageEstimator, whiten: bool
) -> None:
    batch, group_size = case
    spec = AdvantageSpec(estimator, group_size, gamma=0.9, lambd=0.95, whiten=whiten)
    values = rows_for(data, batch)
    base = estimate_advantages(batch, spec, values=values)
    got = estimate_advantages(batch, spec, values=values, token_terms=_opd_terms(data, batch, 0.0))
    assert got == base


@given(st.data(), grouped_samples(), st.sampled_from(ESTIMATORS), st.booleans(), COEF)
def test_the_term_is_added_to_the_estimators_advantages_and_then_whitened(
    data: st.DataObject,
    case: tuple[list[Sample], int],
    estimator: AdvantageEstimator,
    whiten: bool,
    coef: float,
) -> None:
    """As slime's compute_advantages_and_returns: estimator, + OPD, then whitening (asked for,
    or REINFORCE++'s own); the returns (the critic's targets) are the estimator's alone."""
    batch, group_size = case
    spec = AdvantageSpec(estimator, group_size, gamma=0.9, lambd=0.95, whiten=whiten)
    values = rows_for(data, batch)
    terms = _opd_terms(data, batch, coef)
    got = estimate_advantages(batch, spec, values=values, token_terms=terms)
    unwhitened = estimate_advantages(batch, attrs.evolve(spec, whiten=False), values=values)
    assert got.returns == unwhitened.returns
    # The estimator's own advantages before whitening: the returns without a critic.
    base = unwhitened.advantages if estimator == "ppo" else unwhitened.returns
    summed = [
        a + t
        for row, t_row in zip(base, terms, strict=True)
        for a, t in zip(row, t_row, strict=True)
    ]
    flat = [a for row in got.advantages for a in row]
    if whiten or estimator.startswith("reinforce_plus_plus"):
        summed = _whiten(summed)
    assert flat == pytest.approx(summed, rel=1e-9, abs=1e-9)


def _whiten(xs: list[float]) -> list[float]:
    """slime's and verl's whitening: mean 0, unbiased variance, 1e-8 added; one value reads 0."""
    if len(xs) < 2:
        return [0.0] * len(xs)
    mean = math.fsum(xs) / len(xs)
    var = math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_whitening_the_sum_is_not_adding_to_the_whitened() -> None:
    """The order matters: one-token samples with rewards 1, 0, 0 (GRPO: 2/sqrt(3) and twice
    -1/sqrt(3), already whitened) and a term of 3 on the second. slime whitens the sum; adding
    the term to the whitened advantages (rlcore before #34) leaves a variance above 1."""
    batch = [
        Sample(Prompt(0, "", (1,)), Generation((3,), (-1.0,), ""), reward=r, group=0)
        for r in (1.0, 0.0, 0.0)
    ]
    spec = AdvantageSpec("grpo", 3, whiten=True)
    terms = [0.0, 3.0, 0.0]
    plain = [r[0] for r in estimate_advantages(batch, spec).advantages]
    got = [
        r[0] for r in estimate_advantages(batch, spec, token_terms=[(t,) for t in terms]).advantages
    ]
    grpo = [a / (math.sqrt(1.0 / 3.0) + 1e-6) for a in (2.0 / 3.0, -1.0 / 3.0, -1.0 / 3.0)]
    assert plain == pytest.approx(_whiten(grpo))
    assert got == pytest.approx(_whiten([a + t for a, t in zip(grpo, terms, strict=True)]))
    added_after = [a + t for a, t in zip(plain, terms, strict=True)]
    assert got != pytest.approx(added_after, abs=0.1)


def test_rows_that_do_not_line_up_are_refused() -> None:
    with pytest.raises(ValueError, match="1 student and 2 teacher log-prob rows"):
        distillation_advantages([(0.0,)], [(0.0,), (0.0,)], 1.0)
    with pytest.raises(ValueError, match="sample 0 has 1 student and 2 teacher log-probs"):
        distillation_advantages([(0.0,)], [(0.0, 0.0)], 1.0)
    one = [Sample(Prompt(0, "", (1,)), Generation((3, 4), (-1.0, -1.0), ""), reward=1.0, group=0)]
    with pytest.raises(ValueError, match=r"token_terms\[0\] has 1 entries but sample 0 has 2"):
        estimate_advantages(one, AdvantageSpec("grpo", 1), token_terms=[(0.0,)])
