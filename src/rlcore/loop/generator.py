"""A rollout generator that runs ahead of the trainer in a thread of its own, within a staleness.

The generator runs the rollout seam (:data:`~rlcore.loop.rollouts.RolloutSource`) for rollout ids
``first, first + 1, ...`` and keeps each output until the trainer takes it. Its one bound is the
*staleness* ``K``: rollout ``j`` is trained on by policy version ``j`` (the trainer has taken
``j`` optimizer steps' worth of rollouts), so the generator may start rollout ``j`` only once
version ``j - K`` has been published to the engine; every token of it then comes from a version
``>= j - K``. Groups carried over from a rollout (kept dynamic-sampling surplus) were generated
for an earlier rollout id, so before rollout ``j`` is produced the carried groups that would be
more than ``K`` versions old are dropped (and counted); the rollout function tops the rollout up
with fresh prompts in their place.

The trainer's side (:mod:`rlcore.loop.overlap`) publishes versions
(:meth:`RolloutGenerator.publish`) and takes outputs (:meth:`RolloutGenerator.take`). Whenever it
must not run concurrently with
generation (a weight update without partial rollouts, an evaluation, a save), it *holds* the
generator (:meth:`RolloutGenerator.held`): that waits until the generator is between rollouts
(and, with ``through``, has produced every rollout up to that id) and keeps it there. Holding
through rollout ``v`` before publishing version ``v`` makes the schedule lockstep: every rollout
``j`` is generated entirely with version ``j - K``, whatever the timing, which is what makes
``K = 1`` deterministic.

The thread never outlives the run: :meth:`RolloutGenerator.close` stops it after the current
rollout (it is a daemon, so a process that exits does not wait for it), and an error in it is
raised in the trainer's thread by the next :meth:`~RolloutGenerator.take`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from typing import final

import attrs

from rlcore.data.sampler import PromptSampler
from rlcore.errors import RolloutError
from rlcore.loop.rollouts import RolloutSource
from rlcore.protocols.rollout import Group, RolloutOutput

__all__ = ["Produced", "RolloutGenerator", "staleness"]


def staleness(group: Group, trainer_version: int) -> int:
    """How many versions the oldest token of ``group`` lags behind ``trainer_version``."""
    return max(trainer_version - s.response.first_weight_version for s in group)


@final
@attrs.frozen
class Produced:
    """One rollout the generator made: its output, how long it took, how long the generator had
    waited before starting it, and how many carried groups it dropped as too stale."""

    rollout_id: int
    output: RolloutOutput
    generate_s: float = 0.0
    engine_idle_s: float = 0.0
    stale_dropped: int = 0


@final
class RolloutGenerator:
    """Produces rollouts ``first .. end - 1`` ahead of the trainer (module docstring).

    ``produce(rollout_id, sampler, carried)`` is the rollout seam; ``published`` the version the
    engine serves at the start; ``ready`` rollouts produced before (saved with a checkpoint) that
    the trainer takes first; ``carried`` the groups carried into rollout ``first``.
    """

    def __init__(
        self,
        produce: RolloutSource,
        sampler: PromptSampler,
        *,
        first: int,
        end: int,
        max_staleness: int,
        published: int,
        carried: tuple[Group, ...] = (),
        ready: Mapping[int, RolloutOutput] | None = None,
    ) -> None:
        assert max_staleness >= 0
        self._produce = produce
        self.sampler = sampler
        self._next = first
        self._end = end
        self._k = max_staleness
        self._published = published
        self._carried = carried
        self._ready = {i: Produced(i, out) for i, out in (ready or {}).items()}
        if self._ready:
            self._next = max(self._next, max(self._ready) + 1)
        self._cond = threading.Condition()
        self._holds: list[int] = []  # per hold: the last rollout id it lets the generator start
        self._busy = False
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rlcore-rollout-generator")
        self._thread.daemon = True

    # -- the trainer's side ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def take(self, rollout_id: int) -> tuple[Produced, float]:
        """Rollout ``rollout_id`` once it is produced, and how long the trainer waited for it.
        Raises the generator's error if it failed."""
        t0 = time.perf_counter()
        with self._cond:
            while rollout_id not in self._ready:
                self._raise_if_failed()
                if self._stop or (rollout_id < self._next and not self._busy):
                    raise RolloutError(
                        f"the rollout generator has no rollout {rollout_id} and will not make it"
                    )
                self._cond.wait()
            return self._ready.pop(rollout_id), time.perf_counter() - t0

    def publish(self, version: int) -> None:
        """The engine now serves ``version`` (its weights were pushed): rollouts up to
        ``version + K`` may start."""
        with self._cond:
            self._published = version
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self, through: int | None = None, *, wait: bool = True) -> Iterator[bool]:
        """Wait until the generator is between rollouts, having produced every rollout up to
        ``through`` (those that exist), and keep it there for the block: it starts no rollout
        after ``through`` (or, without it, after the one it is making). Yields ``True``; with
        ``wait=False`` it yields ``False`` at once, holding nothing, when the generator is in the
        middle of a rollout."""
        with self._cond:
            if not wait and self._busy:
                held = False
            else:
                held = True
                bound = self._next - 1 if through is None else through
                self._holds.append(bound)
                try:
                    while self._busy or (
                        through is not None and self._next <= min(through, self._end - 1)
                    ):
                        self._raise_if_failed()
                        if self._stop:
                            break
                        self._cond.wait()
                except BaseException:
                    self._holds.remove(bound)
                    self._cond.notify_all()
                    raise
        try:
            yield held
        finally:
            if held:
                with self._cond:
                    self._holds.remove(bound)
                    self._cond.notify_all()

    def pending(self) -> dict[int, RolloutOutput]:
        """The rollouts produced and not yet taken (call while :meth:`held`)."""
        with self._cond:
            return {i: p.output for i, p in sorted(self._ready.items())}

    @property
    def carried(self) -> tuple[Group, ...]:
        """The groups the next rollout to produce starts with (read while :meth:`held`)."""
        return self._carried

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop after the current rollout and wait for the thread (at most ``timeout_s``: a
        generation that does not return is left to the daemon thread). Safe to call twice."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    # -- the generator's thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    waited = time.perf_counter()
                    while not self._stop and (
                        (self._holds and self._next > min(self._holds))
                        or (self._next < self._end and self._published < self._next - self._k)
                    ):
                        self._cond.wait()
                    if self._stop or self._next >= self._end:
                        return
                    rollout_id = self._next
                    self._busy = True
                    idle = time.perf_counter() - waited
                fresh = tuple(g for g in self._carried if staleness(g, rollout_id) <= self._k)
                t0 = time.perf_counter()
                output = self._produce(rollout_id, self.sampler, fresh)
                produced = Produced(
                    rollout_id,
                    output,
                    time.perf_counter() - t0,
                    idle,
                    len(self._carried) - len(fresh),
                )
                with self._cond:
                    self._carried = output.surplus
                    self._ready[rollout_id] = produced
                    self._next = rollout_id + 1
                    self._busy = False
                    self._cond.notify_all()
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._busy = False
                self._cond.notify_all()
