"""The public surface of ``rlcore.algorithms``: other layers code against exactly these names."""

from __future__ import annotations

import rlcore.algorithms as algorithms

EXPECTED = {
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
}


def test_all_is_what_we_mean_to_export() -> None:
    assert set(algorithms.__all__) == EXPECTED
    assert sorted(algorithms.__all__) == list(algorithms.__all__)
    for name in EXPECTED:
        assert getattr(algorithms, name).__module__.startswith("rlcore.algorithms.")


def test_value_classes_are_final() -> None:
    for cls in (
        algorithms.Advantages,
        algorithms.ISWeights,
        algorithms.LossOut,
        algorithms.PolicyLossOut,
        algorithms.TensorBatch,
    ):
        assert getattr(cls, "__final__", False), cls
