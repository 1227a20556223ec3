"""Where a rollout engine runs its servers: a reserved place and the process started there.

The run's placement decides where each :class:`ProcessHost` is and which accelerators it holds; an
engine that runs servers starts one :class:`HostedProcess` per host it is given
(``rlcore.engines.EngineSetup.hosts``). :class:`rlcore.engines.hosts.LocalProcessHost` is this
machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

__all__ = ["HostedProcess", "ProcessHost"]


class HostedProcess(Protocol):
    """A process a :class:`ProcessHost` started (a rollout server), seen from the caller."""

    @property
    def pid(self) -> int:
        """Its process id on its host."""
        ...

    def poll(self) -> int | None:
        """Its exit code once it has exited, else ``None`` (as ``subprocess.Popen.poll``)."""
        ...

    def stop(self, timeout_s: float) -> None:
        """End it and every process it started (SIGTERM, then SIGKILL after ``timeout_s``).
        Safe to call twice."""
        ...

    def log_tail(self, lines: int) -> list[str]:
        """The last ``lines`` lines of its output (stdout and stderr)."""
        ...


class ProcessHost(Protocol):
    """A place a cluster reserved for one rollout server: a machine and its accelerators.

    An engine that runs servers starts one per host it is given (``rlcore.engines.EngineSetup``);
    the run's placement decides where hosts are and which GPUs they hold, the engine decides what
    to run there. :class:`rlcore.engines.hosts.LocalProcessHost` is this machine.
    """

    @property
    def address(self) -> str:
        """The machine's IP address; a server started here listens on it."""
        ...

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        """The CUDA ordinals (as processes on the host number them) reserved for the server, in
        order; empty on a host without GPUs."""
        ...

    @property
    def cpus(self) -> int:
        """CPU threads the server may use without oversubscribing its machine."""
        ...

    def free_port(self) -> int:
        """A TCP port free on the host a moment ago."""
        ...

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> HostedProcess:
        """Start ``argv`` in the host's environment updated with ``env``, output to ``log_path``
        (a path on the host), in a process group of its own. Does not wait for it to be ready.
        Raises :class:`~rlcore.errors.RolloutError` when the program cannot be started."""
        ...
