"""What a person watching a run sees: a log file plus console lines, and a progress bar.

``ProgressSink`` is a metrics sink that drives a rich progress bar ("rollout k of N") and shows
the latest reward and eval score, or logs one plain line per rollout when the output is not a
terminal; ``WandbSink`` logs to Weights & Biases (offline by default when
no API key is set).
"""

from __future__ import annotations

import datetime
import importlib
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, final

import attrs
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from rlcore.config import RunConfig
from rlcore.errors import BackendUnavailableError

__all__ = ["ProgressSink", "WandbSink", "setup_logging"]

log = logging.getLogger("rlcore")


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


def log_to_file(level: int, message: str) -> None:
    """``message`` in the run's log file only (for what the console shows another way)."""
    record = logging.getLogger("rlcore").makeRecord("rlcore", level, __file__, 0, message, (), None)
    for handler in _HANDLERS:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


@final
class ProgressSink:
    """Where the run is. On a terminal, a progress bar: "rollout k/N", the bar, the elapsed time,
    then the latest reward, actor loss and eval scores, cut to the terminal's width (the count
    and the time always show). Elsewhere (output to a file, CI), one plain log line every
    ``every`` rollouts and after the last: the same facts, in ``run.log`` too."""

    def __init__(
        self, total: int, console: Console | None = None, every: int | None = None
    ) -> None:
        self._console = console or Console(stderr=True)
        self._total = total
        self._every = every or max(1, math.ceil(total / 100))  # at most about 100 lines
        self._status: dict[str, str] = {}
        self._speed: dict[str, str] = {}
        self._started = time.monotonic()
        self._progress: Progress | None = None
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("rollout", table_column=_fixed(len("rollout"))),
                MofNCompleteColumn(table_column=_fixed(2 * len(str(total)) + 1)),
                BarColumn(bar_width=_BAR, table_column=_fixed(_BAR)),
                TimeElapsedColumn(table_column=_fixed(len("0:00:00"))),
                TextColumn(
                    "{task.fields[status]}",
                    table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1),
                ),
                console=self._console,
                expand=True,
            )
            self._task = self._progress.add_task("rollouts", total=total, status="")
            self._progress.start()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            if key in ("rollout/reward", "train/actor/loss") or (
                key.startswith("eval/") and key.endswith("/reward")
            ):
                self._status[key.removesuffix("/reward")] = f"{key}={value:.3f}"
            elif key in _SPEED:
                self._speed[key] = _SPEED[key].format(value)
        # The throughput and padding last: cut first on a narrow terminal.
        speed = (self._speed[key] for key in _SPEED if key in self._speed)
        status = "  ".join([*self._status.values(), *speed])
        done = "rollout/weight_version" in metrics  # the loop's per-rollout record
        if self._progress is not None:
            if done:  # its step is the rollout's number, the count done
                self._progress.update(self._task, completed=step)
            self._progress.update(self._task, status=status)
        elif done and (step % self._every == 0 or step == self._total):
            elapsed = datetime.timedelta(seconds=int(time.monotonic() - self._started))
            log.info("rollout %d/%d  %s  %s", step, self._total, elapsed, status)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


_BAR = 20

_SPEED: Final = {
    "perf/actor_train_tokens_per_sec": "train tokens/s={:.0f}",
    "perf/actor_train_padding": "padding={:.0%}",
    "perf/forward_padding": "forward padding={:.0%}",
}
"""The actor's train step's real tokens per second and the share of its positions that were
padding, then that share over the rollout's forward-only passes together (old and reference
log-probs, values, teacher): what ``--use-dynamic-batch-size`` lowers, as the status shows them."""


def _fixed(width: int) -> Column:
    return Column(no_wrap=True, min_width=width)


@final
class WandbSink:
    """Weights & Biases logging. Without ``WANDB_API_KEY`` it runs offline (``wandb sync``
    later). The run's id is kept in ``folder/wandb/rlcore_run_id``; a resumed run
    (``rewind_to``: the first step it logs anew) goes on in that W&B run, rewound to that step
    (W&B's ``resume_from="ID?_step=N"``: what the run logged from step N on is set aside), or
    starts a new W&B run when there is none to go on or W&B refuses the rewind (said in the
    log)."""

    def __init__(self, folder: Path, config: RunConfig, rewind_to: int | None = None) -> None:
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
        kept = folder / "wandb" / "rlcore_run_id"
        earlier = kept.read_text().strip() if rewind_to is not None and kept.is_file() else ""
        settings = {
            "dir": str(folder),
            "mode": mode,
            "config": attrs.asdict(config, value_serializer=_plain),
        }
        try:
            rewind = {"resume_from": f"{earlier}?_step={rewind_to}"} if earlier else {}
            self._run: Any = wandb.init(**settings, **rewind)
        except Exception as exc:  # a server without rewinds, say: the run still logs
            if not earlier:
                raise
            log.warning("wandb: could not rewind run %s (%s); logging to a new run", earlier, exc)
            self._run = wandb.init(**settings)
        else:
            if earlier:
                log.info("wandb: run %s rewound to step %d (%s)", earlier, rewind_to, mode)
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(f"{self._run.id}\n")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def _plain(_inst: object, _field: object, value: object) -> object:
    return str(value) if isinstance(value, Path) else value
