"""On-policy distillation's advantage adjustment: ``A_t - coef * (student_t - teacher_t)``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.distill import distillation_advantages, opd_advantages

LOGP = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)
ADV = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False)
Rows = list[tuple[float, ...]]
Drawn = tuple[Rows, Rows, Rows, list[tuple[int, ...]]]


@st.composite
def rollouts(draw: st.DrawFn) -> Drawn:
    lengths = draw(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=5))

    def rows(values: st.SearchStrategy[float]) -> list[tuple[float, ...]]:
        return [tuple(draw(st.lists(values, min_size=n, max_size=n))) for n in lengths]

    masks = [tuple(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))) for n in lengths]
    return rows(ADV), rows(LOGP), rows(LOGP), masks


@given(rollouts())
def test_coefficient_zero_is_the_base_estimator_bit_for_bit(
    drawn: Drawn,
) -> None:
    advantages, student, teacher, _ = drawn
    assert opd_advantages(advantages, student, teacher, 0.0).advantages == tuple(advantages)


@given(rollouts(), st.floats(min_value=0.0, max_value=5.0))
def test_each_token_loses_coef_times_its_reverse_kl_estimate(drawn: Drawn, coef: float) -> None:
    advantages, student, teacher, masks = drawn
    out = opd_advantages(advantages, student, teacher, coef, masks)
    for row, adv, s_row, t_row in zip(out.advantages, advantages, student, teacher, strict=True):
        for got, a, s, t in zip(row, adv, s_row, t_row, strict=True):
            assert math.isclose(got, a - coef * (s - t), rel_tol=1e-12, abs_tol=1e-9)
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


@given(rollouts(), st.floats(min_value=0.0, max_value=5.0))
def test_pure_distillation_is_exactly_minus_coef_times_the_reverse_kl(
    drawn: Drawn, coef: float
) -> None:
    """--opd-only: no base advantage at all; the metrics are those of opd_advantages."""
    advantages, student, teacher, masks = drawn
    out = distillation_advantages(student, teacher, coef, masks)
    assert out.advantages == tuple(
        tuple(-coef * (s - t) for s, t in zip(s_row, t_row, strict=True))
        for s_row, t_row in zip(student, teacher, strict=True)
    )
    with_base = opd_advantages(advantages, student, teacher, coef, masks)
    assert (out.kl_mean, out.teacher_logprob_mean) == (
        with_base.kl_mean,
        with_base.teacher_logprob_mean,
    )
    # It is what opd_advantages makes of all-zero base advantages (up to the sign of a zero).
    zeros = [(0.0,) * len(row) for row in student]
    assert out.advantages == opd_advantages(zeros, student, teacher, coef, masks).advantages


def test_a_teacher_likelier_than_the_student_raises_the_advantage() -> None:
    out = opd_advantages([(0.0, 0.0)], [(-2.0, -0.5)], [(-0.5, -2.0)], coef=1.0)
    assert out.advantages == ((1.5, -1.5),)
    assert out.kl_mean == 0.0 and out.teacher_logprob_mean == -1.25
    # A sample's empty loss mask means every token is trained, as in Generation.loss_mask.
    assert opd_advantages([(0.0, 0.0)], [(-2.0, -0.5)], [(-0.5, -2.0)], 1.0, [()]) == out


def test_rows_that_do_not_line_up_are_refused() -> None:
    with pytest.raises(ValueError, match="2 advantage rows, 1 student and 2 teacher"):
        opd_advantages([(0.0,), (0.0,)], [(0.0,)], [(0.0,), (0.0,)], 1.0)
    with pytest.raises(ValueError, match="sample 0 has 2 advantages, 1 student and 2 teacher"):
        opd_advantages([(0.0, 0.0)], [(0.0,)], [(0.0, 0.0)], 1.0)
