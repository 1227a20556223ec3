"""Fault tolerance for the servers an :class:`~rlcore_sglang.client.SGLangEngine` launched
(``--use-fault-tolerance``, :class:`~rlcore_sglang.options.FaultTolerance`).

A server that dies, or that the health monitor finds not answering ``/health`` (and stops), is
replaced by a new one on the same host, a bounded number of times and with backoff; the failed
one's log is kept (the new one logs to ``sglang-<i>.restart<n>.log``). Before the new server is
handed out, the engine gives it the weights it serves (see ``SGLangEngine._refresh``): requests
read their server under the lock this class holds while it replaces one. The engine then sends
again the ``/generate`` call that failed: a call is a whole chunk of prompts whose answer never
arrived, so sending it again neither loses nor duplicates a sample.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Final, final

from rlcore.errors import RolloutError, causes
from rlcore.protocols.hosts import ProcessHost
from rlcore_sglang.launcher import LaunchSettings, start_server
from rlcore_sglang.options import FaultTolerance
from rlcore_sglang.server import ServerTimeoutError, ServerUnreachableError, SGLangServer

__all__ = ["Restarter"]

MISSES_TO_STOP: Final = 2
"""Health checks in a row without an answer after which a server is stopped."""
log = logging.getLogger("rlcore")


@final
class Restarter:
    """Replaces failed servers in ``servers`` (the engine's own list, changed in place) and runs
    the health monitor thread until :meth:`close`."""

    def __init__(
        self,
        policy: FaultTolerance,
        settings: LaunchSettings,
        hosts: Sequence[ProcessHost],
        servers: list[SGLangServer],
    ) -> None:
        self.policy = policy
        self._settings = settings
        self._hosts = tuple(hosts)
        self._servers = servers
        self.counts = [0] * len(servers)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._monitor = threading.Thread(
            target=self._watch, name="sglang-health-monitor", daemon=True
        )
        self._monitor.start()

    def server(self, index: int) -> SGLangServer:
        """Server ``index``; waits while it is being replaced (it has no weights until then)."""
        with self._lock:
            return self._servers[index]

    def lost(self, server: SGLangServer, exc: RolloutError) -> bool:
        """Whether a call failed because ``server`` died or did not answer (then it is replaced),
        not because of what was asked."""
        if self._closed.is_set():
            return False
        lost = (ServerUnreachableError, ServerTimeoutError)
        return not server.is_alive() or any(isinstance(c, lost) for c in causes(exc))

    def replace(
        self,
        index: int,
        failed: SGLangServer,
        reason: str,
        prepare: Callable[[int], None] | None = None,
    ) -> None:
        """Replace server ``index`` (which ``failed``) by a new one on the same host; ``prepare``
        (the weights) runs on it before anyone else can reach it. A no-op when another thread
        replaced it already; a :class:`RolloutError` past ``max_restarts``."""
        policy = self.policy
        with self._lock:
            if self._servers[index] is not failed:
                return
            while True:
                if self._closed.is_set():
                    raise RolloutError(f"{failed.describe()} failed ({reason}) while closing")
                attempt = self.counts[index]
                if attempt >= policy.max_restarts:
                    raise RolloutError(
                        f"{failed.describe()} failed ({reason}) and has been restarted "
                        f"{attempt} times (--max-engine-restarts {policy.max_restarts}); find "
                        "why in its log, or raise the limit" + failed.log_tail_text()
                    )
                self.counts[index] = attempt + 1
                log.warning(
                    "%s failed (%s); restarting it (%d of at most %d)",
                    failed.describe(),
                    reason,
                    attempt + 1,
                    policy.max_restarts,
                )
                failed.shutdown(timeout_s=5.0)
                time.sleep(policy.backoff_s * 2**attempt)
                server = start_server(
                    self._settings, self._hosts[index], index, restart=attempt + 1
                )
                self._servers[index] = server
                problem = self._bring_up(server, index, prepare)
                if problem is not None:
                    failed, reason = server, problem  # stopped at the top of the next try
                    continue
                log.warning("%s replaces it", server.describe())
                return

    def _bring_up(
        self, server: SGLangServer, index: int, prepare: Callable[[int], None] | None
    ) -> str | None:
        """``None`` once ``server`` is healthy and prepared; else why it failed (then it is
        tried again). What preparing raises for another reason than the server is raised."""
        try:
            server.wait_until_healthy(self._settings.startup_timeout_s)
        except RolloutError as exc:
            return str(exc).splitlines()[0]
        if prepare is None:
            return None
        try:
            prepare(index)
        except RolloutError as exc:
            if server.is_alive() and not self.lost(server, exc):
                server.shutdown(timeout_s=5.0)  # healthy, but without the weights to serve
                raise
            return str(exc).splitlines()[0]
        return None

    def close(self, timeout_s: float) -> None:
        self._closed.set()
        self._monitor.join(timeout=timeout_s)

    def _watch(self) -> None:
        """The health monitor: a server that answers no ``/health`` in time, ``MISSES_TO_STOP``
        times in a row, is stopped, so that the requests waiting on it fail and it is replaced."""
        policy = self.policy
        misses = [0] * len(self._servers)
        while not self._closed.wait(policy.health_check_interval_s):
            for index, server in enumerate(tuple(self._servers)):
                if self._closed.is_set() or not server.is_alive():
                    continue  # a dead one is replaced by the next call that needs it
                try:
                    server.get("/health", timeout_s=policy.health_check_timeout_s)
                except ServerTimeoutError:
                    misses[index] += 1
                except RolloutError:
                    misses[index] = 0  # refused or an error status: the calls themselves see it
                else:
                    misses[index] = 0
                if misses[index] >= MISSES_TO_STOP:
                    misses[index] = 0
                    log.warning(
                        "%s answered no /health within %g s %d times in a row; stopping it",
                        server.describe(),
                        policy.health_check_timeout_s,
                        MISSES_TO_STOP,
                    )
                    server.shutdown(timeout_s=5.0)
