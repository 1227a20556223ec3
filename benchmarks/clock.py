"""The clocks the step benchmarks time with: wall time, or, on a loaded machine where wall time
says more about the neighbours than about the code, the CPU time of this process and of every
process it started (Ray's GCS, raylet and rank actors included), so that work done in a rank
actor is counted as work done in this process is."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

__all__ = ["Clock", "TreeCPUClock", "wall_clock"]

Clock = Callable[[], float]
"""Seconds since some fixed point; only differences mean anything."""


def wall_clock() -> float:
    return time.perf_counter()


class TreeCPUClock:
    """User + system CPU seconds of this process and all its descendants, summed since the first
    call; a process that has exited keeps what it was last seen to have used (so read the clock
    at least once per step), and a new one counts from its start."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds
        self._total = 0.0

    def __call__(self) -> float:
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    key = (proc.pid, proc.create_time())
            except psutil.Error:  # it exited between the listing and the reading
                continue
            used = times.user + times.system
            before = self._seen.get(key, 0.0)
            if used > before:
                self._total += used - before
                self._seen[key] = used
        return self._total
