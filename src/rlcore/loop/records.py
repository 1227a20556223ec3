"""What a run takes in and gives back: its data, its result, and Ctrl-C's record of progress.

:class:`RunData` is the prompts, :class:`RunResult` what happened, :class:`RunInterrupted` the
``KeyboardInterrupt`` that carries a partial result, and :class:`Progress` what a job has done so
far (kept outside the job's function, so that Ctrl-C can report it), with the request to stop
early (:attr:`Progress.stop`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import attrs

from rlcore.checkpoint_files import rollout_number
from rlcore.samples import EvalSet, Prompt

__all__ = ["NullSink", "Progress", "RunData", "RunInterrupted", "RunResult"]


@attrs.frozen
class RunData:
    """The prompts a run uses: training prompts (empty for eval-only) and eval sets."""

    train_prompts: tuple[Prompt, ...] = ()
    eval_sets: tuple[EvalSet, ...] = ()
    seed: int = 1234


@attrs.frozen
class RunResult:
    """What happened, for callers and tests: the rollout ids trained, saved and evaluated after
    (``-1`` stands for "before training"), and the last metrics of each kind. Ids count from 0,
    as the loop and the rollout seam do; files, metrics steps, logs and ``summary.json`` name
    rollout id ``i`` by its number ``i + 1``
    (:func:`~rlcore.checkpoint_files.rollout_number`)."""

    trained: tuple[int, ...]
    saved: tuple[int, ...]
    evaluated: tuple[int, ...]
    last_eval: Mapping[str, float]
    last_train: Mapping[str, float]
    built: tuple[str, ...] = ()
    """The stacks built, as ``train:ROLE`` / ``eval:ROLE``."""
    rollouts: tuple[int, ...] = ()
    """The rollout ids whose groups came through the rollout seam (generated or replayed; not
    the supervised warm start's)."""
    interrupted: bool = False
    """The run was stopped by Ctrl-C (see :class:`RunInterrupted`)."""
    interrupted_at: int | None = None
    """When interrupted: the rollout id it was working on (its training, save, weight sync or
    eval; ``trained`` says whether its training finished); ``None`` before the first rollout."""
    stopped: bool = False
    """The run stopped early on request (:attr:`Progress.stop`: SIGTERM in the CLI), after its
    last trained rollout was saved."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped :func:`run`. A ``KeyboardInterrupt`` (an ``except Exception`` does not
    catch it) that carries what the run had done by then in :attr:`result`."""

    def __init__(self, result: RunResult) -> None:
        where = (
            f"at rollout {rollout_number(result.interrupted_at)}"
            if result.interrupted_at is not None
            else "before its first rollout"
        )
        super().__init__(f"interrupted {where}")
        self.result = result

    def __reduce__(self) -> tuple[type[RunInterrupted], tuple[RunResult]]:
        return (type(self), (self.result,))


class NullSink:
    """A :class:`~rlcore.protocols.metrics.MetricsSink` that drops everything (no sink given)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        del step, metrics

    def close(self) -> None:
        pass


@attrs.define
class Progress:
    """What a run has done so far, kept outside its function so that Ctrl-C, or the caller of a
    run that failed, can report it."""

    trained: list[int] = attrs.field(factory=list)
    saved: list[int] = attrs.field(factory=list)
    evaluated: list[int] = attrs.field(factory=list)
    rollouts: list[int] = attrs.field(factory=list)
    built: tuple[str, ...] = ()
    current: int | None = None
    stop: threading.Event = attrs.field(factory=threading.Event)
    """Set it (from a signal handler or another thread) to stop the training run at the next
    rollout boundary: the rollout being trained finishes, is saved (with a save folder) and the
    run returns with ``stopped``."""

    def finished(
        self, num_rollout: int, last_eval: Mapping[str, float], last_train: Mapping[str, float]
    ) -> RunResult:
        """The result of a training schedule that returned: after its last rollout
        (``num_rollout - 1``), or ``stopped`` on request before it."""
        return RunResult(
            tuple(self.trained),
            tuple(self.saved),
            tuple(self.evaluated),
            last_eval,
            last_train,
            self.built,
            tuple(self.rollouts),
            stopped=self.trained[-1:] != [num_rollout - 1] and self.stop.is_set(),
        )

    def result(self, *, interrupted: bool = True) -> RunResult:
        """What was done, as a result; ``interrupted``: Ctrl-C stopped the run (else it
        failed)."""
        return RunResult(
            tuple(self.trained),
            tuple(self.saved),
            tuple(self.evaluated),
            {},
            {},
            self.built,
            tuple(self.rollouts),
            interrupted=interrupted,
            interrupted_at=self.current if interrupted else None,
        )
