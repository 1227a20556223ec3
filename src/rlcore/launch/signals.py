"""How a launch meets signals: the first SIGTERM or SIGUSR1 stops the run once the rollout being
trained is saved, a second one (or Ctrl-C) at once; Ctrl-C works however the run was started,
and a second one while the pieces close is ignored."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

from rlcore.loop.records import Progress

__all__ = ["STOP_SIGNALS", "interruptible", "no_second_interrupt", "stop_on_signals"]

log = logging.getLogger("rlcore")


@contextlib.contextmanager
def no_second_interrupt(active: bool) -> Iterator[None]:
    """Ignore Ctrl-C while closing the pieces after a first one (a second would leave Ray and
    the engine half-closed and print a traceback)."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Preemption (``kill``, ``scancel``, a Kubernetes eviction) and SLURM's ``--signal=USR1@T``."""


@contextlib.contextmanager
def stop_on_signals(progress: Progress) -> Iterator[None]:
    """The first SIGTERM or SIGUSR1 asks the run to stop once the rollout being trained is
    saved (:attr:`Progress.stop`); a second one stops it at once, as Ctrl-C does, however soon
    it follows the first.

    Python runs a signal's handler once for every delivery that came before it could run (a flag
    per signal, set by the C-level handler): while the driver waits in a call that checks for
    signals only now and then (``ray.get`` does about once a second), two SIGTERMs 50 ms apart
    reached the handler as one. CPython's C-level handler also writes the number of every
    signal it receives to the wakeup file descriptor (:func:`signal.set_wakeup_fd`), so the
    handler counts the deliveries there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    deliveries, wakeup = os.pipe()
    for fd in (deliveries, wakeup):
        os.set_blocking(fd, False)
    counted = {int(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}

    def arrived() -> int:
        """The stop signals delivered since the handler last ran."""
        numbers = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(deliveries, 4096):
                numbers += chunk
        return max(1, sum(number in counted for number in numbers))

    def handler(signum: int, frame: object) -> None:
        del frame
        name = signal.Signals(signum).name
        if progress.stop.is_set() or arrived() > 1:
            log.warning("%s again: the run stops at once, without saving", name)
            raise KeyboardInterrupt
        progress.stop.set()
        log.warning(
            "%s: the run stops once the rollout being trained is saved (send it again to stop "
            "at once, without saving)",
            name,
        )

    previous_wakeup = signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(previous_wakeup)
        os.close(deliveries)
        os.close(wakeup)


def interruptible() -> None:
    """Ctrl-C (SIGINT) stops the run however it was started. A background job of a
    non-interactive shell (a CI script, ``cmd &`` in a script) inherits SIGINT *ignored*, and
    Python then installs no ``KeyboardInterrupt`` handler: ``kill -INT`` was lost and the run
    trained to its end (the "lost SIGINT" of the Ctrl-C test, which failed only where CI
    started it so)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
