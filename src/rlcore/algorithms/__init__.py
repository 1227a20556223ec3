"""Torch maths for RL post-training: batching, KL estimators, advantage estimators, losses and
importance-sampling corrections of the rollout engine / trainer mismatch.

Imported on demand (``import rlcore`` does not import torch). Shapes are stated in each
function's docstring: ``B`` sequences, ``S`` the padded sequence length, ``T`` the longest
response, ``V`` the vocabulary.
"""

from __future__ import annotations

from rlcore.algorithms.advantages import (
    Advantages,
    estimate_advantages,
    gae,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from rlcore.algorithms.batching import (
    TensorBatch,
    entropy_from_logits,
    gather_response,
    tensorize,
    tensorize_samples,
    token_log_probs,
    unpad,
)
from rlcore.algorithms.correction import ISWeightFn, ISWeights, importance_weights
from rlcore.algorithms.kl import kl_estimate
from rlcore.algorithms.losses import (
    LossOut,
    PolicyLossOut,
    actor_loss,
    aggregate,
    critic_loss,
    loss_normalizer,
    policy_loss,
    value_loss,
)

__all__ = [
    "Advantages",
    "ISWeightFn",
    "ISWeights",
    "LossOut",
    "PolicyLossOut",
    "TensorBatch",
    "actor_loss",
    "aggregate",
    "critic_loss",
    "entropy_from_logits",
    "estimate_advantages",
    "gae",
    "gather_response",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "loss_normalizer",
    "policy_loss",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "tensorize",
    "tensorize_samples",
    "token_log_probs",
    "unpad",
    "value_loss",
]
