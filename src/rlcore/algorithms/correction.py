"""Importance-sampling corrections for the gap between the rollout engine and the trainer.

The engine (SGLang, vLLM, the embedded HF loop) and the trainer (Megatron) compute a token's
log-probability with different kernels, precisions and batch shapes, so the policy that sampled a
rollout is not exactly the policy the trainer differentiates: the update is slightly off-policy.
With ``r_t = pi_train(y_t) / pi_rollout(y_t) = exp(train_t - rollout_t)`` each token's policy loss
is reweighted by a detached ``w`` (:class:`~rlcore.specs.ISCorrection` says which):

- truncated importance sampling, TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl): ``w = clamp(r, low,
  high)`` (``mode="clip"``; slime's ``--use-tis --tis-clip --tis-clip-low``);
- masked importance sampling, IcePop / MIS (Ling team 2025, "IcePop", arXiv:2510.18855; Li et al.
  2025, "When Speed Kills Stability", https://yingru.notion.site/When-Speed-Kills-Stability-
  271211a558b7808d8b12d403fd15edda): ``w = r`` inside ``[low, high]``, ``0`` outside
  (``mode="mask"``);
- the sequence-level (geometric) variant of either: one ratio per sequence,
  ``exp(mean_t log r_t)``, shared by its tokens (``level="geometric"``), and a veto that zeroes a
  sequence with any token ratio below a threshold (the same write-up's rejection sampling).

``train_t`` are the trainer's log-probs at the start of the rollout's training (the proximal
policy of decoupled PPO, Hilton et al. 2021, arXiv:2110.00641): the batch's ``old_log_probs``, or
this pass's detached log-probs with one optimizer step per rollout (the same values).

Shapes: ``B`` sequences, ``T`` the longest response; every tensor is ``Tensor[B, T]`` and ``mask``
is ``BoolTensor[B, T]``.
"""

from __future__ import annotations

import functools
from typing import Protocol, final

import attrs
import torch

from rlcore.imports import load_function
from rlcore.specs import ISCorrection

__all__ = ["ISWeightFn", "ISWeights", "importance_weights", "load_is_weight_fn"]


class ISWeightFn(Protocol):
    """A custom correction (``--custom-tis-function-path module:function``): the weights
    ``Tensor[B, T]`` (``>= 0``; padding is ignored) from the trainer's and the engine's log-probs,
    the response mask and the configured :class:`~rlcore.specs.ISCorrection` (its bounds are the
    flags ``--tis-clip-low`` / ``--tis-clip``). It runs without gradients; the loss multiplies each
    token's policy loss by its weight."""

    def __call__(
        self,
        train_log_probs: torch.Tensor,
        rollout_log_probs: torch.Tensor,
        mask: torch.Tensor,
        spec: ISCorrection,
        /,
    ) -> torch.Tensor: ...


@final
@attrs.frozen(eq=False)  # tensors: compare fields explicitly, not with ==
class ISWeights:
    """:func:`importance_weights`' result. ``weights: Tensor[B, T]`` are detached (0 on padding);
    ``metrics`` are token means over valid tokens: ``tis_weight`` (the weights' mean) and
    ``tis_clipfrac`` (the share of tokens whose weight is not their raw ratio at the chosen level:
    clipped, masked or vetoed)."""

    weights: torch.Tensor
    metrics: dict[str, float]


def importance_weights(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    spec: ISCorrection,
) -> ISWeights:
    """The per-token weights ``spec`` describes (module docstring), without gradients.

    Where the two log-probs are equal every weight is exactly 1 (``spec.low <= 1 <= spec.high``),
    so the corrected loss is the uncorrected one.
    """
    with torch.no_grad():
        train = train_log_probs.detach()
        rollout = rollout_log_probs.detach()
        log_ratio = torch.where(mask, train - rollout, torch.zeros_like(train))
        if spec.level == "geometric":
            n = mask.sum(dim=-1, keepdim=True).clamp_min(1)
            log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / n).expand_as(train)
        ratio = torch.exp(log_ratio)
        if spec.custom_path is not None:
            fn = load_is_weight_fn(spec.custom_path)
            weights = fn(train, rollout, mask, spec).detach()
            if tuple(weights.shape) != tuple(train.shape):
                raise ValueError(
                    f"{spec.custom_path} returned weights of shape {tuple(weights.shape)}; "
                    f"expected {tuple(train.shape)} (one per response token)"
                )
            weights = weights.to(train.dtype)
        elif spec.mode == "clip":
            weights = ratio.clamp(spec.low, spec.high)
        else:
            inside = (ratio >= spec.low) & (ratio <= spec.high)
            weights = torch.where(inside, ratio, torch.zeros_like(ratio))
        if spec.veto_threshold is not None:
            token_ratio = torch.exp(torch.where(mask, train - rollout, torch.zeros_like(train)))
            vetoed = ((token_ratio < spec.veto_threshold) & mask).any(dim=-1, keepdim=True)
            weights = torch.where(vetoed, torch.zeros_like(weights), weights)
        weights = torch.where(mask, weights, torch.zeros_like(weights))
        n_valid = mask.sum().clamp_min(1)
        changed = (weights != ratio) & mask
        metrics = {
            "tis_weight": float(weights.sum() / n_valid),
            "tis_clipfrac": float(changed.sum() / n_valid),
        }
    return ISWeights(weights=weights, metrics=metrics)


@functools.cache
def load_is_weight_fn(path: str) -> ISWeightFn:
    """The function ``--custom-tis-function-path`` names, imported once per process.

    Raises :class:`~rlcore.errors.ConfigError` naming the flag when it cannot be imported or is
    not a function of four arguments.
    """
    fn: ISWeightFn = load_function(
        path,
        field="algorithm.custom_tis_function_path (--custom-tis-function-path)",
        arity=4,
        signature="(train_log_probs, rollout_log_probs, mask, spec) -> weights",
    )
    return fn
