"""Metrics sinks: JSON lines in the run folder (always), TensorBoard and wandb when asked.

Heavy sinks import their library only when constructed; a missing library is a
:class:`~rlcore.errors.BackendUnavailableError` with the install command.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, final

from rlcore.errors import BackendUnavailableError
from rlcore.protocols.metrics import MetricsSink

__all__ = ["JsonlSink", "MultiSink", "StepsFrom", "TensorBoardSink", "read_jsonl_metrics"]


@final
class JsonlSink:
    """One JSON object per ``log`` call: ``{"step": k, "metric/name": value, ...}``. The loop
    logs rollout ``k``'s row (:func:`~rlcore.checkpoint_files.rollout_number`: the count of
    rollouts done) and the evaluation after it at step ``k``, an evaluation before training at
    step 0."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] | None = path.open("a")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._file is None:
            raise ValueError(f"metrics sink {self.path} is closed")
        row: dict[str, float | int | None] = {"step": step}
        # JSON has no NaN/inf: write them as null rather than producing an unreadable file.
        row.update({k: (v if math.isfinite(v) else None) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl_metrics(path: Path) -> list[dict[str, float]]:
    """The rows a :class:`JsonlSink` wrote."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@final
class TensorBoardSink:
    """Scalars into TensorBoard event files under ``folder``. ``purge_step``: a resumed run's
    first step; TensorBoard then hides what earlier event files hold from that step on
    (``SummaryWriter``'s convention for a run that restarts from a checkpoint)."""

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise BackendUnavailableError(
                "TensorBoard logging needs the tensorboard package: pip install tensorboard"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=purge_step)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@final
class StepsFrom:
    """``sink``, given only the steps from ``first`` on: a sink rewound to ``first`` (a resumed
    run's TensorBoard or W&B) keeps what it holds before it."""

    def __init__(self, sink: MetricsSink, first: int) -> None:
        self.sink, self.first = sink, first

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step >= self.first:
            self.sink.log(step, metrics)

    def close(self) -> None:
        self.sink.close()


@final
class MultiSink:
    """Fans out to several sinks."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self.sinks = tuple(sinks)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
