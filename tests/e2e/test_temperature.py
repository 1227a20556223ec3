"""A run at ``--rollout-temperature 0.7`` through the CLI's path (Ray, a Megatron actor in its
Ray actor, the embedded engine): the engine samples from the tempered policy and the trainer
scores that same policy, so their log-probs of every sampled token agree (issue #34)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.config.flags import load_config
from rlcore.launch.cli import execute
from rlcore.loop.metrics import read_jsonl_metrics

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]


def test_a_tempered_run_trains_the_policy_that_sampled(
    demo: Path, tmp_path: Path, ray_cluster: None
) -> None:
    # fmt: off
    flags = [
        "--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "answer", "--num-rollout", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "16",
        "--micro-batch-size", "8", "--rollout-max-response-len", "6", "--lr", "1e-3",
        "--rollout-temperature", "0.7", "--rollout-top-k", "8", "--entropy-coef", "1e-3",
        "--output-dir", str(tmp_path), "--seed", "3",
    ]
    # fmt: on
    result = execute(load_config(flags))
    assert result.trained == (0, 1)
    rows = [r for r in read_jsonl_metrics(tmp_path / "metrics.jsonl") if "rollout/reward" in r]
    assert len(rows) == 2
    for row in rows:
        # fp32 in both: the same tempered distribution in two implementations.
        assert row["train/actor/logprob_mismatch_max"] <= 1e-5
        # One optimizer step per rollout: its old log-probs are this pass's, ratio 1.
        assert row["train/actor/clipfrac"] == 0.0
