"""Per-token estimators of KL(pi || pi_ref) from log-probabilities of tokens sampled from pi.

John Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html: for
``x ~ q`` and ``r = p(x) / q(x)``, with ``q = pi`` (the policy that sampled the tokens) and
``p = pi_ref`` (the reference model)::

    k1 = -log r                     unbiased, high variance, can be negative
    k2 = (log r)^2 / 2              biased, low variance, >= 0
    k3 = (r - 1) - log r            unbiased, low variance, >= 0

``low_var_kl`` is k3 clamped to ``[-10, 10]``, as verl's ``kl_penalty`` computes it (the log-ratio
is first clamped to ``[-20, 20]`` so ``exp`` cannot overflow and poison the gradient of the clamp
with ``0 * inf``).

In terms of our inputs ``log r = ref_log_probs - log_probs``, so ``k1 = log_probs - ref_log_probs``
(verl's ``"k1"``/``"kl"``, OpenRLHF's ``compute_approx_kl`` default).
"""

from __future__ import annotations

import torch

from rlcore.specs import KLType

__all__ = ["kl_estimate"]

_LOW_VAR_LOG_RATIO_LIMIT = 20.0
_LOW_VAR_KL_LIMIT = 10.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: KLType) -> torch.Tensor:
    """Elementwise KL estimate, same shape as the inputs (typically ``Tensor[B, T]``).

    ``log_probs`` are the sampling policy's log-probabilities of the sampled tokens (gradients flow
    through them), ``ref_log_probs`` the reference model's. Padding is not masked here: mask the
    result. ``k2``, ``k3`` and ``low_var_kl`` are ``>= 0``; ``low_var_kl`` lies in ``[0, 10]``.
    """
    log_ratio = ref_log_probs - log_probs  # log r, r = pi_ref / pi
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return _k3(log_ratio)
    if kind == "low_var_kl":
        clamped = log_ratio.clamp(-_LOW_VAR_LOG_RATIO_LIMIT, _LOW_VAR_LOG_RATIO_LIMIT)
        return _k3(clamped).clamp(-_LOW_VAR_KL_LIMIT, _LOW_VAR_KL_LIMIT)
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of k1, k2, k3, low_var_kl")


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(x) - 1 - x`` via ``expm1`` (exact near ``x = 0``, where the two terms cancel), floored
    at 0 so that rounding cannot produce the tiny negatives the true value never has."""
    return (torch.expm1(log_ratio) - log_ratio).clamp_min(0.0)
