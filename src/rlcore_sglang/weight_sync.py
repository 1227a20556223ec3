"""Weights into SGLang servers from whichever process holds them: the three weight sinks.

:class:`TensorSink` (``--weight-sync tensor``)
    ``/update_weights_from_tensor`` with shared-memory handles (CUDA IPC handles for GPU tensors):
    the servers map the sender's memory, nothing is serialised. Runs on the servers' machine
    (:class:`~rlcore.weights.OnHost`). CPU tensors already in shared memory (a CPU rank's
    parameters and export buffers) go as they are and count nothing towards a bucket; the other
    CPU tensors are copied into two reusable shared-memory buffers taking turns, so that filling
    bucket ``k + 1`` overlaps the servers loading bucket ``k``. Servers that registered
    :mod:`rlcore_sglang.server_loader` keep their mappings from one sync to the next. torch is
    switched to the ``file_system`` sharing strategy first (with file descriptors SGLang's
    scheduler dies), process-wide.
:class:`BroadcastSink` (``distributed``)
    The sender is rank 0 of a process group with every server rank (gloo for CPU tensors, NCCL for
    CUDA ones), made once per engine through ``/init_weights_update_group`` and kept in the
    sending process; per bucket, ``/update_weights_from_distributed`` (names, dtypes, shapes)
    while the tensors are broadcast. Runs anywhere the servers can reach
    (:class:`~rlcore.weights.AnyProcess`).
:class:`DiskSink` (``disk``)
    safetensors shards, one per bucket, and their index in a folder the servers read, then
    ``/update_weights_from_disk``. Runs anywhere that shares the folder with the servers.

Every sink reads the weights once, as they come, in buckets holding at most ``bucket_bytes``
(``--update-weight-buffer-size``; a larger tensor goes alone), and puts the new version and a
cache flush on its last call. A sink is a small frozen value (URLs, options, the version) that
pickles: a Megatron rank that holds the tensor-parallel-gathered weights runs it, so the weights
never pass through the driver. What a sink keeps between syncs in the process it runs in (the
shared-memory buffers, the broadcast group) lives in this module's per-process state.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Final, final
from urllib.parse import urlsplit

import attrs
import torch
import torch.distributed as dist
import torch.multiprocessing  # registers torch's pickling reductions with ForkingPickler
from torch._C._distributed_c10d import TCPStore

from rlcore.errors import RolloutError
from rlcore.weights import AnyProcess, NamedTensors, OnHost, on_release
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import (
    CallPolicy,
    SGLangServer,
    first_error,
    free_port,
    post_ok,
    run_all,
    start_all,
    wait_all,
)

__all__ = [
    "BroadcastSink",
    "DiskSink",
    "DistributedWeightSender",
    "ServerRef",
    "TensorSink",
    "close_sender",
    "iter_buckets",
    "pickle_b64",
    "release_shared_buffers",
]

_Named = tuple[str, torch.Tensor]
_ALIGN: Final = 64
_POLL_S: Final = 0.2


@final
@attrs.frozen
class ServerRef:
    """A server as a sink knows it: its URL, tensor-parallel size (ranks that receive) and the
    custom weight loader it registered for tensor-mode updates (``None``: SGLang's own)."""

    url: str
    tp_size: int = 1
    loader: str | None = None

    def server(self) -> SGLangServer:
        return SGLangServer(self.url)


def _policy(options: EngineOptions) -> CallPolicy:
    return CallPolicy(options.connect_retries, options.retry_backoff_s)


def _post_ok(options: EngineOptions, ref: ServerRef, path: str, payload: dict[str, object]) -> None:
    post_ok(ref.server(), path, payload, options.weight_sync_timeout_s, _policy(options))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    weights: NamedTensors, max_bytes: int, held: Callable[[torch.Tensor], int] = _nbytes
) -> Iterator[tuple[list[_Named], bool]]:
    """``(bucket, is_last)``: consecutive runs of ``weights`` holding at most ``max_bytes`` (a
    larger tensor alone), read lazily with one bucket of look-ahead (to know which one is last).
    ``held``: the bytes a tensor holds while its bucket is in flight (default: its size)."""
    pending: list[_Named] | None = None
    bucket: list[_Named] = []
    size = 0
    for name, tensor in weights:
        tensor = tensor.detach()
        nbytes = held(tensor)
        if bucket and size + nbytes > max_bytes:
            if pending is not None:
                yield pending, False
            pending, bucket, size = bucket, [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        if pending is not None:
            yield pending, False
        yield bucket, True
    elif pending is not None:
        yield pending, True


def _version_fields(version: int, last: bool) -> dict[str, object]:
    return {"flush_cache": last, "weight_version": str(version) if last else None}


# -- tensor ---------------------------------------------------------------------------------


@final
@attrs.frozen
class TensorSink:
    """The servers on the machine ``address``: shared-memory handles to each of them."""

    address: str
    servers: tuple[ServerRef, ...]
    version: int
    options: EngineOptions

    @property
    def placement(self) -> OnHost:
        return OnHost(self.address)

    def receive(self, weights: NamedTensors) -> None:
        # With the default file_descriptor strategy the handles need a live connection to this
        # process, which SGLang's scheduler cannot make over HTTP: it dies. (torch leaves
        # set_sharing_strategy unannotated.)
        set_strategy = torch.multiprocessing.set_sharing_strategy
        set_strategy("file_system")  # type: ignore[no-untyped-call]  # unannotated in torch
        with ThreadPoolExecutor(1, thread_name_prefix="rlcore-weights") as sender:
            in_flight: Future[None] | None = None
            buckets = iter_buckets(weights, self.options.bucket_bytes, _held_in_flight)
            for index, (bucket, last) in enumerate(buckets):
                # Buffer index % 2 was last read by the call before the one in flight: free.
                shared = _share(bucket, index % 2)
                if in_flight is not None:
                    in_flight.result()
                request = _version_fields(self.version, last)
                in_flight = sender.submit(self._send, shared, request)
            if in_flight is not None:
                in_flight.result()

    def _send(self, shared: list[_Named], request: dict[str, object]) -> None:
        def one(ref: ServerRef) -> None:
            # One pickle per receiving rank: pickling takes a reference on the shared memory and
            # each unpickling releases one, so a payload must be read once.
            payloads = [pickle_b64(shared) for _ in range(ref.tp_size)]
            body = dict(request, serialized_named_tensors=payloads)
            if ref.loader is not None:
                body["load_format"] = ref.loader
            _post_ok(self.options, ref, "/update_weights_from_tensor", body)

        run_all([partial(one, ref) for ref in self.servers], len(self.servers))


class _SharedBuffers:
    """Two growable shared-memory byte buffers of this process, reused sync after sync (one
    segment each for the servers to map, no fresh pages to fault in every time)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.lock = threading.Lock()


_SHARED = _SharedBuffers()


def _share(bucket: list[_Named], slot: int) -> list[_Named]:
    """The bucket as tensors another process on this machine can map without a further copy.

    CUDA tensors and CPU tensors already in shared memory (a Megatron rank's parameters on the
    CPU, views of them included) go as they are: the server reads the live weights. Only the other
    CPU tensors (those the export made, e.g. q/k/v split out of a fused QKV) are copied, into
    shared buffer ``slot``: one such tensor must not cost a copy of the whole bucket.
    """
    copied = [t for _, t in bucket if not (t.is_cuda or _in_shared_memory(t))]
    offsets, total = _layout(copied)
    buffer: torch.Tensor | None = None
    if copied:
        with _SHARED.lock:
            buffer = _SHARED.buffers[slot]
            if buffer is None or buffer.numel() < total:
                # torch leaves share_memory_ unannotated
                buffer = torch.empty(total, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]  # see above
                _SHARED.buffers[slot] = buffer
                on_release(release_shared_buffers)
    places = iter(offsets)
    out: list[_Named] = []
    for name, tensor in bucket:
        if tensor.is_cuda:
            out.append((name, tensor.contiguous()))
        elif _in_shared_memory(tensor):
            out.append((name, tensor))
        else:
            assert buffer is not None  # allocated above: ``copied`` holds this tensor
            offset, nbytes = next(places), _nbytes(tensor)
            view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            out.append((name, view))
    return out


def _held_in_flight(tensor: torch.Tensor) -> int:
    """The memory a tensor takes while its bucket is in flight: none for a CPU tensor already in
    shared memory (the servers map it where it is), else its size (the shared buffer's copy, or
    a CUDA tensor the servers map, which may be a temporary of the export). So a CPU rank whose
    weights are all shared (its parameters, its export buffers) sends them in one request."""
    return 0 if not tensor.is_cuda and _in_shared_memory(tensor) else _nbytes(tensor)


def _in_shared_memory(tensor: torch.Tensor) -> bool:
    shared: bool = tensor.is_shared()  # type: ignore[no-untyped-call]  # unannotated in torch
    return shared


def release_shared_buffers() -> None:
    """Drop this process's shared-memory buffers (they are made again when needed)."""
    with _SHARED.lock:
        _SHARED.buffers = [None, None]


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets: list[int] = []
    total = 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-_nbytes(tensor) // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def pickle_b64(obj: object) -> str:
    """Pickle with torch's multiprocessing reductions (tensors as shared-memory handles), base64
    for JSON: SGLang's ``MultiprocessingSerializer`` format."""
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


# -- distributed ------------------------------------------------------------------------------


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
                **_version_fields(self.version, last),
            }
            path = "/update_weights_from_distributed"
            calls = start_all(
                [partial(_post_ok, self.options, s, path, payload) for s in self.servers]
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
        calls.append(partial(_post_ok, options, ref, "/init_weights_update_group", payload))
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


# -- disk -------------------------------------------------------------------------------------


@final
@attrs.frozen
class DiskSink:
    """safetensors shards in ``root / weights-v<version>``, loaded by every server."""

    servers: tuple[ServerRef, ...]
    root: Path
    version: int
    options: EngineOptions

    @property
    def placement(self) -> AnyProcess:
        return AnyProcess()

    def receive(self, weights: NamedTensors) -> None:
        folder = self.root / f"weights-v{self.version}"
        _write_shards(weights, folder, self.options.bucket_bytes)
        payload: dict[str, object] = {
            "model_path": str(folder),
            "weight_version": str(self.version),
            "flush_cache": True,
        }
        path = "/update_weights_from_disk"
        run_all(
            [partial(_post_ok, self.options, s, path, payload) for s in self.servers],
            len(self.servers),
        )
        for old in self.root.glob("weights-v*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)


def _write_shards(weights: NamedTensors, folder: Path, max_bytes: int) -> None:
    """One ``bucket-NNNNN.safetensors`` per bucket and ``model.safetensors.index.json`` naming
    them (what Hugging Face loaders, SGLang's included, read), written last."""
    from safetensors.torch import save_file

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for index, (bucket, _) in enumerate(iter_buckets(weights, max_bytes)):
        filename = f"bucket-{index:05d}.safetensors"
        tensors = {name: t.to("cpu").contiguous() for name, t in bucket}
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1))
