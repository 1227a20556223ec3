"""Actor and critic losses: PPO's clipped surrogate and clipped value loss, KL, entropy, SFT terms.

Every loss here is a *sum over sequences of per-sequence token means*::

    loss = sum_i ( sum_t mask_it * l_it ) / max(1, n_i),     n_i = sum_t mask_it

The caller divides by the number of sequences in the *global* batch (all micro-batches on all
data-parallel ranks), so that gradient accumulation and data-parallel averaging give exactly
``mean_i`` over the global batch: micro-batches of different token counts weigh each sequence
the same (GRPO's per-sequence normalisation, Shao et al. 2024, arXiv:2402.03300; the
``loss_type="grpo"`` reduction of TRL and the bench-tiny workload, section 5).

Shapes: ``B`` sequences, ``T`` the longest response; every per-token tensor is ``Tensor[B, T]``
and ``mask`` is ``BoolTensor[B, T]``, True on real response tokens.
"""

from __future__ import annotations

from typing import final

import attrs
import torch

from rlcore.algorithms.batching import TensorBatch
from rlcore.algorithms.kl import kl_estimate
from rlcore.specs import LossSpec

__all__ = [
    "LossOut",
    "PolicyLossOut",
    "actor_loss",
    "critic_loss",
    "policy_loss",
    "value_loss",
]


@final
@attrs.frozen(eq=False)  # tensors: compare fields explicitly, not with ==
class PolicyLossOut:
    """:func:`policy_loss`'s result. ``loss`` is a differentiable scalar (sequence-summed);
    ``clipfrac`` (share of valid tokens whose clipped branch is active) and ``approx_kl`` (k3
    estimate of KL(old || new), token mean) are detached scalars."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor


@final
@attrs.frozen(eq=False)  # tensors: compare fields explicitly, not with ==
class LossOut:
    """A differentiable scalar ``loss`` (sequence-summed: divide by the global batch's number of
    sequences) and float ``metrics``, each a per-sequence mean over this batch (``clipfrac``
    and ``approx_kl`` are token means)."""

    loss: torch.Tensor
    metrics: dict[str, float]


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
) -> PolicyLossOut:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), per token::

        l_t = -min(r_t A_t, clip(r_t, 1 - eps_clip, 1 + eps_clip_high) A_t)
        r_t = exp(logp_t - old_t)

    with the asymmetric upper bound of DAPO (Yu et al. 2025, arXiv:2503.14476, "clip-higher").
    Reduced as the module docstring says (per-sequence token mean, summed over sequences).

    The minimum takes the *unclipped* branch on ties, so where the ratio is inside the trust region
    (including ``eps_clip = 0`` with a ratio of exactly 1) the gradient is ``-A_t grad r_t``; the
    clipped branch is used only where it is strictly smaller, where its gradient is 0 anyway.
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    surrogate = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    is_clipped = clipped < surrogate
    per_token = -torch.where(is_clipped, clipped, surrogate)
    loss = _sequence_sum_of_token_means(per_token, mask)
    with torch.no_grad():
        clipfrac = _token_mean(is_clipped.to(per_token.dtype), mask)
        approx_kl = _token_mean(kl_estimate(old_log_probs, log_probs, "k3"), mask)
    return PolicyLossOut(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float,
) -> torch.Tensor:
    """Clipped value loss, PPO2 style (OpenAI baselines ``ppo2``; OpenRLHF's ``ValueLoss``)::

        v_clip = old + clip(v - old, -value_clip, value_clip)
        l_t    = 0.5 * max((v - R)^2, (v_clip - R)^2)

    ``values``, ``old_values``, ``returns``: ``Tensor[B, T]``. ``old_values = None`` gives the
    unclipped ``0.5 (v - R)^2``. Returns the sequence-summed scalar (module docstring).
    """
    unclipped = (values - returns).square()
    if old_values is None:
        per_token = 0.5 * unclipped
    else:
        v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
        per_token = 0.5 * torch.maximum(unclipped, (v_clip - returns).square())
    return _sequence_sum_of_token_means(per_token, mask)


def actor_loss(
    log_probs: torch.Tensor,
    batch: TensorBatch,
    spec: LossSpec,
    entropy: torch.Tensor | None = None,
) -> LossOut:
    """The actor's loss on ``batch``: ``log_probs: Tensor[B, T]`` are the current policy's
    (differentiable, from :func:`~rlcore.algorithms.batching.token_log_probs`)::

        loss = policy_loss(log_probs, old, A)
             + kl_loss_coef * sum_i mean_t kl(log_probs, ref)     if spec.use_kl_loss
             - entropy_coef * sum_i mean_t entropy                if entropy_coef > 0

    ``old`` is ``batch.old_log_probs``, or ``log_probs.detach()`` when that is ``None`` (one
    optimizer step per rollout: the ratio is exactly 1, nothing is clipped, and
    ``loss / B`` is bench-tiny's ``mean_i sum_t(mask * -exp(logp - sg(logp)) A) / n_i``, with
    gradient ``-mean_i (A_i / n_i) sum_t grad logp_it``). The KL loss (GRPO's, arXiv:2402.03300)
    needs ``batch.ref_log_probs``; the entropy bonus needs ``entropy: Tensor[B, T]`` (from
    :func:`~rlcore.algorithms.batching.entropy_from_logits`). A supervised warm start needs no
    term of its own: the policy loss with every advantage 1 and ratio 1 has the SFT gradient.

    Metrics: ``pg_loss``, ``clipfrac``, ``approx_kl``, and when used ``kl_loss``, ``entropy``;
    ``logprob_mismatch`` (mean |rollout engine's log-prob - this pass's|, over response tokens)
    when ``batch.rollout_log_probs`` is set; plus ``loss``. Raises ``ValueError`` when a term's
    input is missing.
    """
    mask = batch.response_mask
    b = max(batch.num_sequences, 1)
    old = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
    pg = policy_loss(log_probs, old, batch.advantages, mask, spec.eps_clip, spec.eps_clip_high)
    loss = pg.loss
    metrics = {
        "pg_loss": float(pg.loss.detach()) / b,
        "clipfrac": float(pg.clipfrac),
        "approx_kl": float(pg.approx_kl),
    }
    if spec.use_kl_loss:
        if batch.ref_log_probs is None:
            raise ValueError(
                "LossSpec.use_kl_loss is set but the batch has no ref_log_probs: "
                "compute them with the reference model"
            )
        kl = kl_estimate(log_probs, batch.ref_log_probs, spec.kl_loss_type)
        kl_loss = _sequence_sum_of_token_means(kl, mask)
        loss = loss + spec.kl_loss_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach()) / b
    if spec.entropy_coef > 0 and entropy is None:
        raise ValueError(
            f"LossSpec.entropy_coef = {spec.entropy_coef} > 0 needs entropy: "
            "pass entropy=entropy_from_logits(logits, batch)"
        )
    if entropy is not None:
        mean_entropy = _sequence_sum_of_token_means(entropy, mask)
        if spec.entropy_coef > 0:
            loss = loss - spec.entropy_coef * mean_entropy
        metrics["entropy"] = float(mean_entropy.detach()) / b
    if batch.rollout_log_probs is not None:
        gap = (log_probs.detach() - batch.rollout_log_probs).abs()
        metrics["logprob_mismatch"] = float(gap[mask].mean()) if bool(mask.any()) else 0.0
    metrics["loss"] = float(loss.detach()) / b
    return LossOut(loss=loss, metrics=metrics)


def critic_loss(values: torch.Tensor, batch: TensorBatch, spec: LossSpec) -> LossOut:
    """The critic's clipped value loss on ``batch``: ``values: Tensor[B, T]`` are the current
    critic's ``V(s_t)`` (from :func:`~rlcore.algorithms.batching.gather_response`), regressed on
    ``batch.returns`` and clipped around ``batch.old_values`` (unclipped when ``None``) with
    ``spec.value_clip``. Metrics: ``value_loss``, ``value_clipfrac`` (share of valid tokens whose
    clipped error is the larger), ``values`` (token mean), ``loss``. Raises ``ValueError`` without
    returns.
    """
    if batch.returns is None:
        raise ValueError("critic_loss needs batch.returns: estimate advantages with a critic (ppo)")
    mask = batch.response_mask
    b = max(batch.num_sequences, 1)
    loss = value_loss(values, batch.old_values, batch.returns, mask, spec.value_clip)
    with torch.no_grad():
        if batch.old_values is None:
            clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
        else:
            old = batch.old_values
            v_clip = old + (values - old).clamp(-spec.value_clip, spec.value_clip)
            larger = (v_clip - batch.returns).square() > (values - batch.returns).square()
            clipfrac = _token_mean(larger.to(values.dtype), mask)
        mean_value = _token_mean(values, mask)
    value = float(loss.detach()) / b
    metrics = {
        "value_loss": value,
        "value_clipfrac": float(clipfrac),
        "values": float(mean_value),
        "loss": value,
    }
    return LossOut(loss=loss, metrics=metrics)


def _sequence_sum_of_token_means(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_i sum_t(mask_it x_it) / max(1, n_i)`` for ``x: Tensor[B, T]``: a scalar.
    ``where`` (not a product) so that a non-finite value on padding cannot leak in."""
    per_sequence = torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1)
    return (per_sequence / mask.sum(dim=-1).clamp_min(1)).sum()


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask``'s True entries (0 when there are none): a scalar."""
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp_min(1)
