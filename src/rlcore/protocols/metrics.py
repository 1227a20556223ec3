"""Where a run's metrics go: a sink that receives them, namespaced, at each rollout id.

The loop logs its ``rollout/...``, ``train/...`` and ``eval/...`` metrics to a
:class:`MetricsSink`; :mod:`rlcore.loop.metrics` has the sinks a run uses (``metrics.jsonl``,
TensorBoard).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["MetricsSink"]


class MetricsSink(Protocol):
    """Receives namespaced metrics (``rollout/...``, ``train/...``, ``eval/...``) at a rollout
    id."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...
