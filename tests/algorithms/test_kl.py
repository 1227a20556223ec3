"""KL estimators (Schulman, "Approximating KL Divergence")."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.kl import kl_estimate
from rlcore.specs import KLType

KINDS: tuple[KLType, ...] = ("k1", "k2", "k3", "low_var_kl")


def test_hand_computed_values() -> None:
    # log p = log 0.5, log ref = log 0.25: log r = log(ref / p) = -log 2, r = 1/2.
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    ln2 = math.log(2.0)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(ln2)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1.0 + ln2)
    assert kl_estimate(logp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1.0 + ln2)
    # Reversed: r = 2, k1 = -ln 2, k3 = 2 - 1 - ln 2.
    assert kl_estimate(ref, logp, "k1").item() == pytest.approx(-ln2)
    assert kl_estimate(ref, logp, "k3").item() == pytest.approx(1.0 - ln2)


def test_all_estimators_vanish_when_the_policies_agree() -> None:
    x = torch.tensor([-3.0, -0.1, 0.0])
    for kind in KINDS:
        assert torch.equal(kl_estimate(x, x, kind), torch.zeros(3))


def test_low_var_kl_clamps_at_ten_with_finite_gradient() -> None:
    logp = torch.tensor([-100.0, -1.0], requires_grad=True)
    ref = torch.tensor([0.0, -1.0])
    # log r = 100: k3 = e^100 - 101 overflows float32; low_var_kl reads 10 and has gradient 0.
    kl = kl_estimate(logp, ref, "low_var_kl")
    assert kl.tolist() == [10.0, 0.0]
    (grad,) = torch.autograd.grad(kl.sum(), logp)
    assert grad.tolist() == [0.0, 0.0]


def test_unknown_kind_is_refused() -> None:
    x = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(x, x, "k4")  # type: ignore[arg-type]  # the runtime guard for untyped callers


log_probs = st.floats(-30.0, 0.0, allow_nan=False)


@given(st.lists(st.tuples(log_probs, log_probs), min_size=1, max_size=20))
def test_k3_is_nonnegative_and_low_var_kl_is_within_ten(pairs: list[tuple[float, float]]) -> None:
    for dtype in (torch.float32, torch.float64):
        logp = torch.tensor([a for a, _ in pairs], dtype=dtype)
        ref = torch.tensor([b for _, b in pairs], dtype=dtype)
        k3 = kl_estimate(logp, ref, "k3")
        low = kl_estimate(logp, ref, "low_var_kl")
        assert bool(torch.all(k3 >= 0))
        assert bool(torch.all((low >= -10) & (low <= 10)))
        assert bool(torch.all(kl_estimate(logp, ref, "k2") >= 0))


@given(
    st.lists(st.floats(-4.0, 4.0, allow_nan=False), min_size=2, max_size=8).flatmap(
        lambda q: st.tuples(
            st.just(q),
            st.lists(st.floats(-4.0, 4.0, allow_nan=False), min_size=len(q), max_size=len(q)),
        )
    )
)
def test_k1_and_k3_are_unbiased_under_the_sampling_policy(
    logits: tuple[list[float], list[float]],
) -> None:
    # Exact expectation over a categorical: sum_x q(x) k(x) = KL(q || p) for k1 and k3.
    q_logits, p_logits = logits
    log_q = torch.log_softmax(torch.tensor(q_logits, dtype=torch.float64), dim=0)
    log_p = torch.log_softmax(torch.tensor(p_logits, dtype=torch.float64), dim=0)
    q = log_q.exp()
    true_kl = float((q * (log_q - log_p)).sum())
    unbiased: tuple[KLType, ...] = ("k1", "k3")
    for kind in unbiased:
        expected = float((q * kl_estimate(log_q, log_p, kind)).sum())
        assert expected == pytest.approx(true_kl, abs=1e-9)
