"""Distributed-mode weight sync (``--weight-sync distributed``): a broadcast to every server rank.

The process running a :class:`BroadcastSink` is rank 0 of a process group with every server rank
(gloo for CPU tensors, NCCL for CUDA ones), made once per engine through
``/init_weights_update_group`` and kept in the sending process (:class:`DistributedWeightSender`,
this module's per-process state; :func:`close_sender` leaves it); per bucket,
``/update_weights_from_distributed`` (names, dtypes, shapes) while the tensors are broadcast. It
runs anywhere the servers can reach (:class:`~rlcore.weights.AnyProcess`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from functools import partial
from typing import Final, final
from urllib.parse import urlsplit

import attrs
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from rlcore.errors import RolloutError
from rlcore.weights import AnyProcess, NamedTensors
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import first_error, free_port, start_all, wait_all
from rlcore_sglang.weight_sync.base import ServerRef, iter_buckets, post_ok_to, version_fields

__all__ = ["BroadcastSink", "DistributedWeightSender", "close_sender"]

_POLL_S: Final = 0.2


@final
@attrs.frozen
class BroadcastSink:
    """Every server, through a process group whose rank 0 is the process running this sink."""

    servers: tuple[ServerRef, ...]
    group_name: str
    version: int
    options: EngineOptions

    @property
    def placement(self) -> AnyProcess:
        return AnyProcess()

    def receive(self, weights: NamedTensors) -> None:
        timeout = self.options.weight_sync_timeout_s
        sender: DistributedWeightSender | None = None
        for bucket, last in iter_buckets(weights, self.options.bucket_bytes):
            if sender is None:  # the first bucket says where the tensors are: gloo or NCCL
                sender = _sender_for(self, cuda=bucket[0][1].is_cuda)
            payload: dict[str, object] = {
                "names": [name for name, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
                **version_fields(self.version, last),
            }
            path = "/update_weights_from_distributed"
            calls = start_all(
                [partial(post_ok_to, self.options, s, path, payload) for s in self.servers]
            )
            try:
                sender.broadcast([t for _, t in bucket], calls, timeout)
            except RolloutError:
                # The group is in an unknown state: the next sync builds a new one.
                close_sender(self.group_name, self.servers)
                raise
            wait_all(calls)


_SENDERS: dict[str, DistributedWeightSender] = {}
"""This process's broadcast groups, by group name (one per engine)."""


def _sender_for(sink: BroadcastSink, *, cuda: bool) -> DistributedWeightSender:
    sender = _SENDERS.get(sink.group_name)
    if sender is not None:
        return sender
    for stale in [name for name in _SENDERS if name != sink.group_name]:
        close_sender(stale)  # an engine that is gone: one group per sending process at a time
    options = sink.options
    backend = options.dist_backend
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    address = options.master_address or _address_towards(sink.servers[0].url)
    port = free_port(address)
    world_size = 1 + sum(ref.tp_size for ref in sink.servers)
    calls: list[Callable[[], object]] = []
    rank_offset = 1
    for ref in sink.servers:
        payload: dict[str, object] = {
            "master_address": address,
            "master_port": port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": sink.group_name,
            "backend": backend,
        }
        calls.append(partial(post_ok_to, options, ref, "/init_weights_update_group", payload))
        rank_offset += ref.tp_size
    # The servers' init calls block until rank 0 (this process) joins: run them concurrently.
    pending = start_all(calls)
    try:
        sender = DistributedWeightSender.join(
            address,
            port,
            world_size,
            backend=backend,
            group_name=sink.group_name,
            timeout_s=options.weight_sync_timeout_s,
            abort_if=lambda: first_error(pending),
        )
    except BaseException:
        wait_all(pending, swallow=True)
        raise
    wait_all(pending)
    _SENDERS[sink.group_name] = sender
    return sender


def close_sender(group_name: str, servers: Sequence[ServerRef] = ()) -> None:
    """Leave this process's group ``group_name`` (if it has one) and ask ``servers`` to destroy
    theirs (best effort: a server may be the reason the group is dropped)."""
    sender = _SENDERS.pop(group_name, None)
    if sender is not None:
        sender.close()
    for ref in servers:
        try:
            ref.server().post(
                "/destroy_weights_update_group", {"group_name": group_name}, timeout_s=30.0
            )
        except RolloutError:
            pass


def _address_towards(url: str) -> str:
    """This machine's address on the route to ``url`` (what the server can connect back to)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, parts.port or 80))  # a UDP "connect" sends nothing
        address: str = probe.getsockname()[0]
        return address


@final
class DistributedWeightSender:
    """The sender's end of SGLang's weight-update group: rank 0 of a process group of its own
    (the default group, if any, is untouched), broadcasting tensors that every server receives.

    SGLang's ``/init_weights_update_group`` makes each server rank join a group created by the
    same TCP rendezvous, with the group name as store prefix; this class joins it the same way.
    """

    def __init__(self, group: dist.ProcessGroup, world_size: int) -> None:
        self._group: dist.ProcessGroup | None = group
        self.world_size = world_size

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        world_size: int,
        *,
        backend: str = "gloo",
        group_name: str = "rlcore_weight_sync",
        timeout_s: float = 600.0,
        abort_if: Callable[[], BaseException | None] = lambda: None,
    ) -> DistributedWeightSender:
        """Host the rendezvous at ``master_address:master_port`` as rank 0 and wait (at most
        ``timeout_s``, giving up early when ``abort_if`` returns an error) for the other
        ``world_size - 1`` ranks."""
        from torch.distributed.distributed_c10d import (
            Backend,
            GroupName,
            PrefixStore,
            _new_process_group_helper,
            _world,
        )

        timeout = timedelta(seconds=timeout_s)
        store_box: list[TCPStore] = []
        error_box: list[BaseException] = []

        def host_store() -> None:
            try:
                store_box.append(
                    TCPStore(
                        master_address,
                        master_port,
                        world_size,
                        is_master=True,
                        timeout=timeout,
                        wait_for_workers=True,
                    )
                )
            except BaseException as exc:
                error_box.append(exc)

        waiter = threading.Thread(target=host_store, daemon=True)
        waiter.start()
        deadline = time.monotonic() + timeout_s
        while waiter.is_alive():
            waiter.join(_POLL_S)
            failure = abort_if()
            if failure is not None:
                raise RolloutError(
                    f"the weight-update group was not joined: {failure}"
                ) from failure
            if time.monotonic() > deadline:
                raise RolloutError(
                    f"the SGLang servers did not join the weight-update group at "
                    f"{master_address}:{master_port} within {timeout_s:.0f} s; check that they can "
                    "reach this address (EngineOptions.master_address)"
                )
        if error_box:
            raise RolloutError(
                f"could not host the weight-update rendezvous: {error_box[0]}"
            ) from error_box[0]
        store = PrefixStore(group_name, store_box[0])
        # Private torch API, the same call SGLang makes on its side: a group outside the default
        # world, so a process that already runs torch.distributed (a Megatron rank) is undisturbed.
        group, _ = _new_process_group_helper(
            world_size,
            0,
            [],
            Backend(backend),
            store,
            group_name=GroupName(group_name),
            timeout=timeout,
        )
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        return cls(group, world_size)

    def broadcast(
        self,
        tensors: Sequence[torch.Tensor],
        watch: Sequence[Future[None]] = (),
        timeout_s: float = 600.0,
    ) -> None:
        """Broadcast ``tensors`` in order from rank 0. Gives up with a :class:`RolloutError` when a
        future in ``watch`` (the servers' HTTP calls) fails or ``timeout_s`` passes."""
        if self._group is None:
            raise RolloutError("DistributedWeightSender is closed")
        works = [
            dist.broadcast(t.contiguous(), group=self._group, group_src=0, async_op=True)
            for t in tensors
        ]
        deadline = time.monotonic() + timeout_s
        for work in works:
            assert work is not None
            while not work.is_completed():
                failure = first_error(watch)
                if failure is not None:
                    raise RolloutError(f"weight broadcast abandoned: {failure}") from failure
                if time.monotonic() > deadline:
                    raise RolloutError(
                        f"weight broadcast did not finish within {timeout_s:.0f} s; are the "
                        "servers still receiving?"
                    )
                time.sleep(0.001)
            work.wait()

    def close(self) -> None:
        """Leave the group. Safe to call twice."""
        if self._group is not None:
            group, self._group = self._group, None
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError):
                pass
