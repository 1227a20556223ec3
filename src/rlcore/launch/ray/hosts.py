"""Rollout servers' places on a Ray cluster: a small actor in an engine's first slot that starts
the server on that node and kills it when the actor dies (:class:`RayProcessHost`, a
:class:`~rlcore.protocols.ProcessHost`), and the server process seen through it
(:class:`RayHostedProcess`). :class:`~rlcore.launch.ray.cluster.ClusterPlacement` starts them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, final

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

__all__ = ["HOST_ACTOR", "RayHostedProcess", "RayProcessHost"]

_CALL_S: Final = 60.0


@final
class _HostActor:
    """Runs one server process on its node: a :class:`~rlcore.engines.hosts.LocalProcessHost` whose
    processes die with this actor. Its methods run on the actor's main thread (a plain actor),
    which is what the parent-death signal is tied to."""

    def __init__(self, address: str, cpus: int) -> None:
        from rlcore.engines.hosts import LocalProcessHost

        self._host = LocalProcessHost(address, cpus=cpus, die_with_parent=True)
        # By pid: a server restarted under --use-fault-tolerance is a second process here.
        self._processes: dict[int, Any] = {}

    def ping(self) -> bool:
        return True

    def free_port(self) -> int:
        return self._host.free_port()

    def start(self, argv: list[str], env: dict[str, str], log_path: str) -> int:
        process = self._host.start(argv, env, Path(log_path))
        pid: int = process.pid
        self._processes[pid] = process
        return pid

    def poll(self, pid: int) -> int | None:
        code: int | None = self._processes[pid].poll()
        return code

    def stop(self, pid: int, timeout_s: float) -> None:
        self._processes[pid].stop(timeout_s)

    def stop_all(self, timeout_s: float) -> None:
        for process in self._processes.values():
            process.stop(timeout_s)

    def log_tail(self, pid: int, lines: int) -> list[str]:
        tail: list[str] = self._processes[pid].log_tail(lines)
        return tail


HOST_ACTOR: Final[Any] = ray.remote(_HostActor)
"""The host actor class, started in a rollout engine's slot by the run's placement."""


@final
class RayProcessHost:
    """A :class:`~rlcore.protocols.ProcessHost` on a cluster node: calls go to the host actor."""

    def __init__(self, actor: Any, address: str, gpu_ids: tuple[int, ...], cpus: int) -> None:
        self._actor = actor
        self._address = address
        self._gpu_ids = gpu_ids
        self._cpus = cpus

    @property
    def address(self) -> str:
        return self._address

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return self._gpu_ids

    @property
    def cpus(self) -> int:
        return self._cpus

    def ping(self) -> None:
        _call(self._actor.ping, "starting the rollout host")

    def free_port(self) -> int:
        port: int = _call(self._actor.free_port, "picking a port")
        return port

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> RayHostedProcess:
        pid: int = _call(
            self._actor.start, "starting a server", list(argv), dict(env), str(log_path)
        )
        return RayHostedProcess(self._actor, pid)


@final
class RayHostedProcess:
    """A :class:`~rlcore.protocols.HostedProcess` started by a :class:`RayProcessHost`. When the
    host actor is gone (its node died), the process counts as exited with code -9."""

    def __init__(self, actor: Any, pid: int) -> None:
        self._actor = actor
        self._pid = pid

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        try:
            code: int | None = ray.get(self._actor.poll.remote(self._pid), timeout=_CALL_S)
        except RayActorError:
            return -9
        return code

    def stop(self, timeout_s: float) -> None:
        try:
            ray.get(self._actor.stop.remote(self._pid, timeout_s), timeout=timeout_s * 2 + _CALL_S)
        except RayError:
            pass  # the actor (and with it the process) is gone

    def log_tail(self, lines: int) -> list[str]:
        try:
            tail: list[str] = ray.get(
                self._actor.log_tail.remote(self._pid, lines), timeout=_CALL_S
            )
        except RayError:
            return []
        return tail


def _call(method: Any, what: str, *args: object) -> Any:
    from rlcore.errors import RolloutError

    try:
        return ray.get(method.remote(*args), timeout=_CALL_S)
    except (RayError, GetTimeoutError) as exc:
        raise RolloutError(f"rollout host: {what} failed: {exc}") from exc
