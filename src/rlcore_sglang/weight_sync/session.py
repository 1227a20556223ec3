"""The engine's side of a weight update: which sinks it hands out, in a session on every server.

:class:`WeightUpdates` belongs to one :class:`~rlcore_sglang.client.SGLangEngine`. For the
engine's ``weight_sync`` mode it makes the sinks of an update (one
:class:`~rlcore_sglang.weight_sync.tensor.TensorSink` per machine with servers, or one
:class:`~rlcore_sglang.weight_sync.distributed.BroadcastSink` /
:class:`~rlcore_sglang.weight_sync.disk.DiskSink` for all of them) and opens a
``/begin_weight_update`` ... ``/end_weight_update`` session around them on each server (SGLang
0.5.23 refuses tensor and distributed updates outside one). A failure inside the session is
re-raised with the log tail of a server that died. It also owns what the engine's syncs keep
between updates: the broadcast group's name and a temporary folder for disk syncs.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final, final
from urllib.parse import urlsplit

from rlcore.errors import RolloutError
from rlcore.weights import WeightSink
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import CallPolicy, SGLangServer, on_all, post_ok
from rlcore_sglang.weight_sync.base import ServerRef
from rlcore_sglang.weight_sync.disk import DiskSink
from rlcore_sglang.weight_sync.distributed import BroadcastSink, close_sender
from rlcore_sglang.weight_sync.tensor import TensorSink

__all__ = ["WeightUpdates"]

_GROUP_NAME: Final = "rlcore_weight_sync"


@final
class WeightUpdates:
    """Weight updates of an engine's servers.

    ``servers`` is the engine's own list (a server restarted under fault tolerance replaces its
    predecessor in it); ``tp_sizes`` and ``loaders`` say, per server, how many ranks receive and
    which weight loader it registered; ``hosts``: the address of each server's machine (default:
    the host in its URL), by which tensor-mode sinks are grouped.
    """

    def __init__(
        self,
        servers: list[SGLangServer],
        options: EngineOptions,
        policy: CallPolicy,
        *,
        tp_sizes: tuple[int, ...],
        loaders: tuple[str | None, ...],
        hosts: Sequence[str] | None = None,
    ) -> None:
        self._servers = servers
        self._options = options
        self._policy = policy
        self._tp_sizes = tp_sizes
        self._loaders = loaders
        self._hosts = (
            tuple(hosts) if hosts is not None else tuple(_url_host(s.url) for s in servers)
        )
        self._own_sync_dir: Path | None = None
        self._broadcast_used = False
        # Unique per engine: a server keeps a stale group under its name until it is destroyed.
        self._group_name = f"{_GROUP_NAME}_{uuid.uuid4().hex[:8]}"

    @contextmanager
    def session(self, version: int, indices: Sequence[int]) -> Iterator[list[WeightSink]]:
        """The sinks of an update to ``version`` of the servers ``indices``, inside a weight
        update session on each of them (none for disk syncs)."""
        servers = [self._servers[i] for i in indices]
        sinks = self._sinks(version, indices)
        session = self._options.weight_sync != "disk"
        if session:
            on_all(servers, self._begin)
        try:
            yield sinks
        except BaseException as exc:
            if session:
                try:
                    on_all(servers, self._end)
                except RolloutError:
                    pass  # best effort: the first failure is the one to report
            dead = [server for server in servers if not server.is_alive()]
            if dead and isinstance(exc, Exception):
                raise _died(dead[0], version, exc) from exc
            raise
        if session:
            on_all(servers, self._end)

    def post_ok(self, server: SGLangServer, path: str, payload: Mapping[str, object]) -> None:
        """POST to ``server`` within the weight-sync timeout; an error unless it succeeds."""
        post_ok(server, path, payload, self._options.weight_sync_timeout_s, self._policy)

    def leave_group(self) -> None:
        """Leave the broadcast group, if a sync made one, and ask the servers to destroy theirs."""
        if self._broadcast_used:
            close_sender(self._group_name, self._refs())

    def remove_sync_dir(self) -> None:
        """Remove the temporary folder of disk syncs, if one was made here."""
        if self._own_sync_dir is not None:
            shutil.rmtree(self._own_sync_dir, ignore_errors=True)

    def _refs(self, indices: Sequence[int] | None = None) -> tuple[ServerRef, ...]:
        chosen = range(len(self._servers)) if indices is None else indices
        return tuple(
            ServerRef(self._servers[i].url, self._tp_sizes[i], self._loaders[i]) for i in chosen
        )

    def _sinks(self, version: int, indices: Sequence[int]) -> list[WeightSink]:
        mode = self._options.weight_sync
        if mode == "tensor":
            by_host: dict[str, list[int]] = {}
            for index in indices:
                by_host.setdefault(self._hosts[index], []).append(index)
            return [
                TensorSink(host, self._refs(indices), version, self._options)
                for host, indices in by_host.items()
            ]
        if mode == "distributed":
            self._broadcast_used = True
            return [BroadcastSink(self._refs(indices), self._group_name, version, self._options)]
        return [DiskSink(self._refs(indices), self._sync_root(), version, self._options)]

    def _sync_root(self) -> Path:
        if self._options.sync_dir is not None:
            return self._options.sync_dir
        if self._own_sync_dir is None:
            self._own_sync_dir = Path(tempfile.mkdtemp(prefix="rlcore-sglang-weights-"))
        return self._own_sync_dir

    def _begin(self, server: SGLangServer) -> None:
        try:
            self.post_ok(server, "/begin_weight_update", {})
        except RolloutError as exc:
            if "already open" not in str(exc):
                raise
            # A session left open by a client that died mid-sync: close it, start afresh.
            self.post_ok(server, "/end_weight_update", {})
            self.post_ok(server, "/begin_weight_update", {})

    def _end(self, server: SGLangServer) -> None:
        self.post_ok(server, "/end_weight_update", {})


def _died(server: SGLangServer, version: int, cause: Exception) -> RolloutError:
    return RolloutError(
        f"weight update to version {version} failed ({cause}) and "
        f"{server.describe()} is no longer running" + server.log_tail_text()
    )


def _url_host(url: str) -> str:
    """The machine a server runs on, from its URL (loopback names stay loopback: the weight
    source maps them to the machine of whoever opened the update)."""
    return urlsplit(url).hostname or "127.0.0.1"
