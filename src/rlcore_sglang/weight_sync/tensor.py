"""Tensor-mode weight sync (``--weight-sync tensor``): shared memory the servers map.

:class:`TensorSink` posts ``/update_weights_from_tensor`` with shared-memory handles (CUDA IPC
handles for GPU tensors): the servers map the sender's memory, nothing is serialised. It runs on
the servers' machine (:class:`~rlcore.weights.OnHost`). CPU tensors already in shared memory (a
CPU rank's parameters and export buffers) go as they are and count nothing towards a bucket; the
other CPU tensors are copied into two reusable shared-memory buffers taking turns, so that filling
bucket ``k + 1`` overlaps the servers loading bucket ``k``. Servers that registered
:mod:`rlcore_sglang.server_loader` keep their mappings from one sync to the next. torch is
switched to the ``file_system`` sharing strategy first (with file descriptors SGLang's scheduler
dies), process-wide. The two buffers are this module's per-process state
(:func:`release_shared_buffers` drops them).
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from multiprocessing.reduction import ForkingPickler
from typing import Final, final

import attrs
import torch
import torch.multiprocessing  # registers torch's pickling reductions with ForkingPickler

from rlcore.weights import NamedTensors, OnHost, on_release
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import run_all
from rlcore_sglang.weight_sync.base import (
    Named,
    ServerRef,
    iter_buckets,
    post_ok_to,
    tensor_bytes,
    version_fields,
)

__all__ = ["TensorSink", "pickle_b64", "release_shared_buffers"]

_ALIGN: Final = 64


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
                request = version_fields(self.version, last)
                in_flight = sender.submit(self._send, shared, request)
            if in_flight is not None:
                in_flight.result()

    def _send(self, shared: list[Named], request: dict[str, object]) -> None:
        def one(ref: ServerRef) -> None:
            # One pickle per receiving rank: pickling takes a reference on the shared memory and
            # each unpickling releases one, so a payload must be read once.
            payloads = [pickle_b64(shared) for _ in range(ref.tp_size)]
            body = dict(request, serialized_named_tensors=payloads)
            if ref.loader is not None:
                body["load_format"] = ref.loader
            post_ok_to(self.options, ref, "/update_weights_from_tensor", body)

        run_all([partial(one, ref) for ref in self.servers], len(self.servers))


class _SharedBuffers:
    """Two growable shared-memory byte buffers of this process, reused sync after sync (one
    segment each for the servers to map, no fresh pages to fault in every time)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.lock = threading.Lock()


_SHARED = _SharedBuffers()


def _share(bucket: list[Named], slot: int) -> list[Named]:
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
    out: list[Named] = []
    for name, tensor in bucket:
        if tensor.is_cuda:
            out.append((name, tensor.contiguous()))
        elif _in_shared_memory(tensor):
            out.append((name, tensor))
        else:
            assert buffer is not None  # allocated above: ``copied`` holds this tensor
            offset, nbytes = next(places), tensor_bytes(tensor)
            view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            out.append((name, view))
    return out


def _held_in_flight(tensor: torch.Tensor) -> int:
    """The memory a tensor takes while its bucket is in flight: none for a CPU tensor already in
    shared memory (the servers map it where it is), else its size (the shared buffer's copy, or
    a CUDA tensor the servers map, which may be a temporary of the export). So a CPU rank whose
    weights are all shared (its parameters, its export buffers) sends them in one request."""
    return 0 if not tensor.is_cuda and _in_shared_memory(tensor) else tensor_bytes(tensor)


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
        total += -(-tensor_bytes(tensor) // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def pickle_b64(obj: object) -> str:
    """Pickle with torch's multiprocessing reductions (tensors as shared-memory handles), base64
    for JSON: SGLang's ``MultiprocessingSerializer`` format."""
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")
