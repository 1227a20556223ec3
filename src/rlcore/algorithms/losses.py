"""Actor and critic losses: PPO's clipped surrogate (per token, or per sequence for GSPO) with an
optional importance-sampling correction, the clipped value loss, KL and entropy terms.

Every loss here returns a *numerator* ``N`` that the caller divides by
``loss_normalizer(mode, global_mask)``, computed once over the *global* batch (all micro-batches
on all data-parallel ranks): gradient accumulation and data-parallel summing then give exactly
the aggregate over the global batch, whatever the split. The aggregation modes
(:data:`~rlcore.specs.LossAggMode`), with ``n_i`` sequence ``i``'s loss-mask tokens::

    seq-mean-token-mean         N = sum_i sum_t m_it l_it / max(1, n_i)    normaliser: B
    token-mean                  N = sum_i sum_t m_it l_it                  normaliser: sum_i n_i
    seq-mean-token-sum-budget   N = sum_i sum_t m_it l_it / C              normaliser: B

``seq-mean-token-mean`` weighs every sequence the same (GRPO's per-sequence normalisation, Shao et
al. 2024, arXiv:2402.03300; TRL's ``loss_type="grpo"``; bench-tiny's loss). ``token-mean`` weighs
every token the same, so long responses are not down-weighted (DAPO, Yu et al. 2025,
arXiv:2503.14476, section 3.3; slime's ``--calculate-per-token-loss``); both are verl's modes of
the same name (an empty loss mask: README, "Algorithms"). ``seq-mean-token-sum-budget`` divides each
sequence's token sum by a constant ``C`` instead of its length, removing GRPO's length bias, and
averages over sequences: Dr. GRPO's ``(1/G) sum_i sum_t`` (Liu et al. 2025, arXiv:2503.20783,
section 3.1; ``C`` is the generation budget, as in TRL's ``loss_type="dr_grpo"``). verl's
``seq-mean-token-sum-norm`` is ``sum_i sum_t m_it l_it / C`` per micro-batch with no division by a
sequence count, so its value over a global batch is ``B`` times this one only with one
micro-batch on one rank, and moves with the micro-batch and data-parallel sizes otherwise; a
number that a split changes has no place here, hence another name.

Shapes: ``B`` sequences, ``T`` the longest response; every per-token tensor is ``Tensor[B, T]`` and
``mask`` is ``BoolTensor[B, T]``, True on the tokens the loss counts: ``batch.loss_mask``, the
model's own response tokens (a multi-turn episode's environment tokens and padding are False, so
every term, normaliser and metric below ignores them).
"""

from __future__ import annotations

from typing import final

import attrs
import torch

from rlcore.algorithms.batching import TensorBatch
from rlcore.algorithms.correction import importance_weights
from rlcore.algorithms.kl import kl_estimate
from rlcore.specs import LossAggMode, LossSpec, RatioLevel

__all__ = [
    "LossOut",
    "PolicyLossOut",
    "actor_loss",
    "aggregate",
    "critic_loss",
    "loss_normalizer",
    "policy_loss",
    "value_loss",
]


@final
@attrs.frozen(eq=False)  # tensors: compare fields explicitly, not with ==
class PolicyLossOut:
    """:func:`policy_loss`'s result. ``loss`` is a differentiable scalar numerator (module
    docstring); ``clipfrac`` (share of valid tokens whose clipped branch is active),
    ``approx_kl`` (k3 estimate of KL(old || new), token mean) and ``dual_clipfrac`` (share of
    valid tokens held at dual-clip's bound, verl's ``pg_clipfrac_lower``; 0 without it) are
    detached scalars."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor
    dual_clipfrac: torch.Tensor


@final
@attrs.frozen(eq=False)  # tensors: compare fields explicitly, not with ==
class LossOut:
    """A differentiable scalar numerator ``loss`` (divide by
    ``loss_normalizer(spec.agg_mode, global_mask)``) and float ``metrics``.

    ``normalizer`` is this batch's own share of that normaliser (its sequence count, or its token
    count for ``token-mean``), ``tokens`` its number of valid tokens. Loss parts (``loss``,
    ``pg_loss``, ``kl_loss``, ``entropy``, ``value_loss``) are their numerators divided by
    ``normalizer``: weighting each micro-batch's value by its ``normalizer`` and dividing by the
    global normaliser gives the global batch's value exactly. The keys in ``token_metrics``
    (``clipfrac``, ``approx_kl``, ``logprob_mismatch``, ``tis_*``, ...) are token means: weight
    them by ``tokens`` and divide by the global token count. ``maxima`` hold maxima over this
    batch's tokens (``logprob_mismatch_max``): reduce them with ``max``.
    """

    loss: torch.Tensor
    metrics: dict[str, float]
    normalizer: float = 1.0
    tokens: int = 0
    token_metrics: frozenset[str] = frozenset()
    maxima: dict[str, float] = attrs.field(factory=dict)


def aggregate(
    x: torch.Tensor, mask: torch.Tensor, mode: LossAggMode, constant: int = 1
) -> torch.Tensor:
    """The numerator of ``mode``'s aggregate of ``x: Tensor[B, T]`` over ``mask`` (module
    docstring): a scalar. ``constant`` is ``C`` of ``seq-mean-token-sum-budget``. ``where`` (not a
    product) so that a non-finite value on padding cannot leak in."""
    per_sequence = torch.where(mask, x, torch.zeros_like(x)).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        return (per_sequence / mask.sum(dim=-1).clamp_min(1)).sum()
    if mode == "token-mean":
        return per_sequence.sum()
    if mode == "seq-mean-token-sum-budget":
        return per_sequence.sum() / constant
    raise ValueError(f"unknown loss aggregation mode {mode!r}")


def loss_normalizer(mode: LossAggMode, mask: torch.Tensor) -> float:
    """What to divide the summed numerators of a *global* batch by: its number of valid tokens
    for ``token-mean``, its number of sequences otherwise (at least 1). ``mask:
    BoolTensor[B, T]`` is the global batch's loss mask (``TensorBatch.loss_mask``)."""
    count = int(mask.sum()) if mode == "token-mean" else int(mask.shape[0])
    return float(max(count, 1))


def _local_normalizer(mode: LossAggMode, mask: torch.Tensor) -> float:
    return float(int(mask.sum()) if mode == "token-mean" else int(mask.shape[0]))


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    *,
    eps_clip_c: float | None = None,
    ratio_level: RatioLevel = "token",
    weights: torch.Tensor | None = None,
    agg_mode: LossAggMode = "seq-mean-token-mean",
    agg_constant: int = 1,
) -> PolicyLossOut:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), per token::

        l_t = -w_t min(r_t A_t, clip(r_t, 1 - eps_clip, 1 + eps_clip_high) A_t)

    with the asymmetric upper bound of DAPO (Yu et al. 2025, arXiv:2503.14476, "clip-higher").
    ``eps_clip_c`` (> 1; ``None``: off) is dual-clip PPO (Ye et al. 2020, arXiv:1912.09729;
    slime's ``--eps-clip-c``, verl's ``clip_ratio_c``): where ``A_t < 0`` the clipped loss is
    bounded, ``l_t = -w_t max(min(r_t A_t, clip(r_t) A_t), c A_t)``, so a token whose ratio has
    grown past ``c`` loses at most ``c |A_t|`` and gets no gradient.
    ``ratio_level="token"``: ``r_t = exp(logp_t - old_t)``. ``ratio_level="sequence"`` (GSPO,
    Zheng et al. 2025, arXiv:2507.18071): every token of sequence ``i`` uses
    ``s_i = exp(mean_t (logp_t - old_t))``, the geometric mean of its token ratios, so the whole
    sequence is clipped or not (GSPO's per-sequence objective when ``A`` is constant over a
    sequence, as GRPO's advantages are). ``weights: Tensor[B, T]`` (detached, e.g. from
    :func:`~rlcore.algorithms.correction.importance_weights`) default to 1. Reduced with
    :func:`aggregate` (``agg_mode``, ``agg_constant``).

    The minimum takes the *unclipped* branch on ties, so where the ratio is inside the trust region
    (including ``eps_clip = 0`` with a ratio of exactly 1) the gradient is ``-A_t grad r_t``; the
    clipped branch is used only where it is strictly smaller, where its gradient is 0 anyway.
    """
    log_ratio = log_probs - old_log_probs
    if ratio_level == "sequence":
        n = mask.sum(dim=-1, keepdim=True).clamp_min(1)
        masked = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
        log_ratio = (masked.sum(dim=-1, keepdim=True) / n).expand_as(log_probs)
    ratio = torch.exp(log_ratio)
    surrogate = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    is_clipped = clipped < surrogate
    per_token = -torch.where(is_clipped, clipped, surrogate)
    is_dual = torch.zeros_like(is_clipped)
    if eps_clip_c is not None:
        bound = -eps_clip_c * advantages  # c |A| where A < 0
        is_dual = (advantages < 0) & (per_token > bound)  # strictly: ties keep the gradient
        per_token = torch.where(is_dual, bound, per_token)
    if weights is not None:
        per_token = per_token * weights
    loss = aggregate(per_token, mask, agg_mode, agg_constant)
    with torch.no_grad():
        clipfrac = _token_mean(is_clipped.to(per_token.dtype), mask)
        approx_kl = _token_mean(kl_estimate(old_log_probs, log_probs, "k3"), mask)
        dual_clipfrac = _token_mean(is_dual.to(per_token.dtype), mask)
    return PolicyLossOut(
        loss=loss, clipfrac=clipfrac, approx_kl=approx_kl, dual_clipfrac=dual_clipfrac
    )


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float,
    *,
    agg_mode: LossAggMode = "seq-mean-token-mean",
    agg_constant: int = 1,
) -> torch.Tensor:
    """Clipped value loss, PPO2 style (OpenAI baselines ``ppo2``; OpenRLHF's ``ValueLoss``)::

        v_clip = old + clip(v - old, -value_clip, value_clip)
        l_t    = 0.5 * max((v - R)^2, (v_clip - R)^2)

    ``values``, ``old_values``, ``returns``: ``Tensor[B, T]``. ``old_values = None`` gives the
    unclipped ``0.5 (v - R)^2``. Returns the :func:`aggregate` numerator (module docstring).
    """
    unclipped = (values - returns).square()
    if old_values is None:
        per_token = 0.5 * unclipped
    else:
        v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
        per_token = 0.5 * torch.maximum(unclipped, (v_clip - returns).square())
    return aggregate(per_token, mask, agg_mode, agg_constant)


def actor_loss(
    log_probs: torch.Tensor,
    batch: TensorBatch,
    spec: LossSpec,
    entropy: torch.Tensor | None = None,
) -> LossOut:
    """The actor's loss on ``batch``: ``log_probs: Tensor[B, T]`` are the current policy's
    (differentiable, from :func:`~rlcore.algorithms.batching.token_log_probs`)::

        loss = policy_loss(log_probs, old, A, weights=w)
             + kl_loss_coef * aggregate(kl(log_probs, ref))     if spec.use_kl_loss
             - entropy_coef * aggregate(entropy)                if entropy_coef > 0

    each term aggregated as ``spec.agg_mode`` says. ``old`` is ``batch.old_log_probs``, or
    ``log_probs.detach()`` when that is ``None`` (one optimizer step per rollout: the ratio is
    exactly 1, nothing is clipped, and with the default aggregation ``loss / B`` is bench-tiny's
    ``mean_i sum_t(mask * -exp(logp - sg(logp)) A) / n_i``, with gradient
    ``-mean_i (A_i / n_i) sum_t grad logp_it``). ``w`` are the importance weights of
    ``spec.correction`` between ``old`` and the engine's ``batch.rollout_log_probs`` (1 without a
    correction, and for a batch without engine log-probs, such as a supervised warm start). The KL
    loss (GRPO's, arXiv:2402.03300) needs ``batch.ref_log_probs``; the entropy bonus needs
    ``entropy: Tensor[B, T]`` (from :func:`~rlcore.algorithms.batching.entropy_from_logits`). A
    supervised warm start needs no term of its own: the policy loss with every advantage 1 and
    ratio 1 has the SFT gradient.

    Metrics (see :class:`LossOut`): ``pg_loss``, ``clipfrac``, ``approx_kl``, and when used
    ``dual_clipfrac`` (``spec.eps_clip_c``), ``kl_loss``, ``entropy``, ``tis_weight``,
    ``tis_clipfrac``; with engine log-probs
    ``logprob_mismatch`` (mean ``|old - rollout|``, or ``|log_probs - rollout|`` with
    ``spec.use_rollout_logprobs``, whose ``old`` *are* the engine's) and the maximum
    ``logprob_mismatch_max``; plus ``loss``. Raises ``ValueError`` when a term's input is missing.
    """
    mask = batch.loss_mask
    mode, constant = spec.agg_mode, spec.agg_constant
    norm = _local_normalizer(mode, mask)
    per = max(norm, 1.0)
    old = batch.old_log_probs if batch.old_log_probs is not None else log_probs.detach()
    metrics: dict[str, float] = {}
    maxima: dict[str, float] = {}
    weights = None
    rollout = batch.rollout_log_probs
    if spec.correction is not None and rollout is not None:
        corrected = importance_weights(old, rollout, mask, spec.correction)
        weights = corrected.weights
        metrics.update(corrected.metrics)
    pg = policy_loss(
        log_probs,
        old,
        batch.advantages,
        mask,
        spec.eps_clip,
        spec.eps_clip_high,
        eps_clip_c=spec.eps_clip_c,
        ratio_level=spec.ratio_level,
        weights=weights,
        agg_mode=mode,
        agg_constant=constant,
    )
    loss = pg.loss
    metrics.update(
        pg_loss=float(pg.loss.detach()) / per,
        clipfrac=float(pg.clipfrac),
        approx_kl=float(pg.approx_kl),
    )
    if spec.eps_clip_c is not None:
        metrics["dual_clipfrac"] = float(pg.dual_clipfrac)
    if spec.use_kl_loss:
        if batch.ref_log_probs is None:
            raise ValueError(
                "LossSpec.use_kl_loss is set but the batch has no ref_log_probs: "
                "compute them with the reference model"
            )
        kl = kl_estimate(log_probs, batch.ref_log_probs, spec.kl_loss_type)
        kl_loss = aggregate(kl, mask, mode, constant)
        loss = loss + spec.kl_loss_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach()) / per
    if spec.entropy_coef > 0 and entropy is None:
        raise ValueError(
            f"LossSpec.entropy_coef = {spec.entropy_coef} > 0 needs entropy: "
            "pass entropy=entropy_from_logits(logits, batch)"
        )
    if entropy is not None:
        entropy_sum = aggregate(entropy, mask, mode, constant)
        if spec.entropy_coef > 0:
            loss = loss - spec.entropy_coef * entropy_sum
        metrics["entropy"] = float(entropy_sum.detach()) / per
    if rollout is not None:
        compared = log_probs.detach() if spec.use_rollout_logprobs else old
        gap = torch.where(mask, (compared - rollout).abs(), torch.zeros_like(rollout))
        metrics["logprob_mismatch"] = float(_token_mean(gap, mask))
        maxima["logprob_mismatch_max"] = float(gap.max()) if gap.numel() else 0.0
    metrics["loss"] = float(loss.detach()) / per
    token_metrics = frozenset(metrics) & _ACTOR_TOKEN_MEANS
    return LossOut(loss, metrics, norm, int(mask.sum()), token_metrics, maxima)


def critic_loss(values: torch.Tensor, batch: TensorBatch, spec: LossSpec) -> LossOut:
    """The critic's clipped value loss on ``batch``: ``values: Tensor[B, T]`` are the current
    critic's ``V(s_t)`` (from :func:`~rlcore.algorithms.batching.gather_response`), regressed on
    ``batch.returns`` and clipped around ``batch.old_values`` (unclipped when ``None``) with
    ``spec.value_clip``, aggregated as ``spec.agg_mode`` says. Metrics: ``value_loss``,
    ``value_clipfrac`` (share of valid tokens whose clipped error is the larger), ``values``
    (token mean), ``loss``. Raises ``ValueError`` without returns.
    """
    if batch.returns is None:
        raise ValueError("critic_loss needs batch.returns: estimate advantages with a critic (ppo)")
    mask = batch.loss_mask
    norm = _local_normalizer(spec.agg_mode, mask)
    loss = value_loss(
        values,
        batch.old_values,
        batch.returns,
        mask,
        spec.value_clip,
        agg_mode=spec.agg_mode,
        agg_constant=spec.agg_constant,
    )
    with torch.no_grad():
        if batch.old_values is None:
            clipfrac = torch.zeros((), dtype=values.dtype, device=values.device)
        else:
            old = batch.old_values
            v_clip = old + (values - old).clamp(-spec.value_clip, spec.value_clip)
            larger = (v_clip - batch.returns).square() > (values - batch.returns).square()
            clipfrac = _token_mean(larger.to(values.dtype), mask)
        mean_value = _token_mean(values, mask)
    value = float(loss.detach()) / max(norm, 1.0)
    metrics = {
        "value_loss": value,
        "value_clipfrac": float(clipfrac),
        "values": float(mean_value),
        "loss": value,
    }
    token_metrics = frozenset({"value_clipfrac", "values"})
    return LossOut(loss, metrics, norm, int(mask.sum()), token_metrics)


_ACTOR_TOKEN_MEANS = frozenset(
    {"clipfrac", "dual_clipfrac", "approx_kl", "logprob_mismatch", "tis_weight", "tis_clipfrac"}
)


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask``'s True entries (0 when there are none): a scalar."""
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp_min(1)
