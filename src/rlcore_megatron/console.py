"""What a person watching a run sees: a log file plus console lines, and a progress bar.

``ProgressSink`` is a metrics sink that drives a rich progress bar ("rollout k of N") and shows
the latest reward and eval score; ``WandbSink`` logs to Weights & Biases (offline by default when
no API key is set).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, final

import attrs
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlcore.config import RunConfig
from rlcore.errors import BackendUnavailableError

__all__ = ["ProgressSink", "WandbSink", "setup_logging"]


_HANDLERS: list[logging.Handler] = []


def setup_logging(log_file: Path) -> None:
    """INFO and up to the console (rich) and to ``log_file``; calling again replaces both."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    logger = logging.getLogger("rlcore")
    logger.setLevel(logging.INFO)
    while _HANDLERS:
        old = _HANDLERS.pop()
        logger.removeHandler(old)
        old.close()
    file_handler = logging.FileHandler(log_file)
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _HANDLERS.extend([file_handler, RichHandler(console=Console(stderr=True), show_path=False)])
    for handler in _HANDLERS:
        logger.addHandler(handler)


@final
class ProgressSink:
    """A progress bar over the rollouts, with the latest reward and eval metrics beside it."""

    def __init__(self, total: int) -> None:
        self._progress = Progress(
            TextColumn("rollout"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=Console(stderr=True),
            transient=False,
        )
        self._task = self._progress.add_task("rollouts", total=total, status="")
        self._status: dict[str, str] = {}
        self._progress.start()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if "rollout/weight_version" in metrics:
            self._progress.update(self._task, completed=step + 1)
        for key, value in metrics.items():
            if key in ("rollout/reward", "train/actor/loss") or (
                key.startswith("eval/") and key.endswith("/reward")
            ):
                self._status[key.removesuffix("/reward")] = f"{key}={value:.3f}"
        self._progress.update(self._task, status="  ".join(self._status.values()))

    def close(self) -> None:
        self._progress.stop()


@final
class WandbSink:
    """Weights & Biases logging. Without ``WANDB_API_KEY`` it runs offline (``wandb sync``
    later)."""

    def __init__(self, folder: Path, config: RunConfig) -> None:
        try:
            wandb: Any = importlib.import_module(
                "wandb"
            )  # untyped and optional: resolved at run time
        except ImportError as exc:
            raise BackendUnavailableError(
                "--use-wandb needs the wandb package: pip install wandb"
            ) from exc
        mode = os.environ.get(
            "WANDB_MODE", "online" if os.environ.get("WANDB_API_KEY") else "offline"
        )
        self._run: Any = wandb.init(
            dir=str(folder), mode=mode, config=attrs.asdict(config, value_serializer=_plain)
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def _plain(_inst: object, _field: object, value: object) -> object:
    return str(value) if isinstance(value, Path) else value
