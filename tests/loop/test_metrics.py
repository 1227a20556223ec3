"""Metrics sinks: JSON lines always, TensorBoard when asked."""

from __future__ import annotations

import functools
import io
import math
import threading
from pathlib import Path

import attrs
import pytest
from rich.console import Console

from rlcore.loop.metrics import (
    JsonlSink,
    MultiSink,
    StepsFrom,
    TensorBoardSink,
    read_jsonl_metrics,
)


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

    # tensorboard ships no type information (no py.typed, no stubs)
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {
        "rollout/reward",
        "train/actor/loss",
        "eval/heldout/reward",
    }
    assert [e.value for e in events.Scalars("eval/heldout/reward")] == [1.0]


def test_a_resumed_tensorboard_sink_takes_over_from_its_first_step(tmp_path: Path) -> None:
    """A first attempt logged rollouts 1..3 and the evaluation after 2; a run resumed from
    rollout 2 purges 3 (TensorBoard's purge_step) and is given nothing before it (its own
    evaluation of rollout 2 stays the first attempt's): every step reads once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = TensorBoardSink(tmp_path / "tb")
    for step in (1, 2, 3):
        first.log(step, {"rollout/reward": float(step)})
    first.log(2, {"eval/heldout/reward": 0.25})
    first.close()
    resumed = StepsFrom(TensorBoardSink(tmp_path / "tb", purge_step=3), 3)
    resumed.log(2, {"eval/heldout/reward": 0.5})  # the resumed run's evaluation before training
    for step in (3, 4):
        resumed.log(step, {"rollout/reward": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward")] == [
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]
    assert [(e.step, e.value) for e in events.Scalars("eval/heldout/reward")] == [(2, 0.25)]


def test_a_sink_that_fails_to_start_stops_those_started_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wandb sink that cannot start must not leave the progress display's thread running."""
    from rlcore.config.flags import load_config
    from rlcore.launch import pieces as run_module
    from rlcore.launch.console import ProgressSink
    from rlcore.loop.plan import plan

    class UnreachableWandb:
        def __init__(self, folder: Path, config: object, rewind_to: int | None) -> None:
            raise RuntimeError("wandb cannot start")

    monkeypatch.setattr(run_module, "WandbSink", UnreachableWandb)
    # On a terminal, where the progress display runs a refresh thread (elsewhere it only logs).
    terminal = Console(file=io.StringIO(), force_terminal=True)
    monkeypatch.setattr(
        run_module, "ProgressSink", functools.partial(ProgressSink, console=terminal)
    )
    config = load_config(
        [
            *("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
            *("--global-batch-size", "4", "--micro-batch-size", "4"),
            *("--use-wandb", "--output-dir", str(tmp_path)),
        ]
    )
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="wandb cannot start"):
        run_module.start_sinks(config, plan(config))
    # rich's refresh thread is told to stop, not joined: give it a moment to exit
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:
        thread.join(timeout=5.0)
    assert [t for t in started if t.is_alive()] == []
    # without wandb the same sinks do start a display thread, so the check above can fail
    sink = run_module.start_sinks(attrs.evolve(config, use_wandb=False), plan(config))
    assert [t for t in threading.enumerate() if t not in before and t.is_alive()] != []
    sink.close()
