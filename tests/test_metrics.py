"""Metrics sinks: JSON lines always, TensorBoard when asked."""

from __future__ import annotations

import math
from pathlib import Path

from rlcore.metrics import JsonlSink, MultiSink, TensorBoardSink, read_jsonl_metrics


def test_jsonl_and_tensorboard_sinks_record_every_metric(tmp_path: Path) -> None:
    jsonl = JsonlSink(tmp_path / "run" / "metrics.jsonl")
    sink = MultiSink([jsonl, TensorBoardSink(tmp_path / "tb")])
    sink.log(0, {"rollout/reward": 0.5, "train/actor/loss": math.nan})
    sink.log(1, {"eval/heldout/reward": 1.0})
    sink.close()
    rows = read_jsonl_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows == [
        {"step": 0, "rollout/reward": 0.5, "train/actor/loss": None},
        {"step": 1, "eval/heldout/reward": 1.0},
    ]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {
        "rollout/reward",
        "train/actor/loss",
        "eval/heldout/reward",
    }
    assert [e.value for e in events.Scalars("eval/heldout/reward")] == [1.0]
