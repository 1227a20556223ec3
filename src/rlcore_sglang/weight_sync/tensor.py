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
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import final

import attrs
import torch

from rlcore.engines.shared_tensors import SharedBuffers, dumps, in_shared_memory, use_file_system
from rlcore.weights import NamedTensors, OnHost
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
        use_file_system()
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


_SHARED = SharedBuffers(2)


def _share(bucket: list[Named], slot: int) -> list[Named]:
    """The bucket as tensors another process on this machine can map without a further copy.

    CUDA tensors and CPU tensors already in shared memory (a Megatron rank's parameters on the
    CPU, views of them included) go as they are: the server reads the live weights. Only the other
    CPU tensors (those the export made, e.g. q/k/v split out of a fused QKV) are copied, into
    shared buffer ``slot``: one such tensor must not cost a copy of the whole bucket.
    """
    return _SHARED.share(bucket, slot, keep_cuda=True)


def _held_in_flight(tensor: torch.Tensor) -> int:
    """The memory a tensor takes while its bucket is in flight: none for a CPU tensor already in
    shared memory (the servers map it where it is), else its size (the shared buffer's copy, or
    a CUDA tensor the servers map, which may be a temporary of the export). So a CPU rank whose
    weights are all shared (its parameters, its export buffers) sends them in one request."""
    return 0 if in_shared_memory(tensor) else tensor_bytes(tensor)


def release_shared_buffers() -> None:
    """Drop this process's shared-memory buffers (they are made again when needed)."""
    _SHARED.release()


def pickle_b64(obj: object) -> str:
    """Pickle with torch's multiprocessing reductions (tensors as shared-memory handles), base64
    for JSON: SGLang's ``MultiprocessingSerializer`` format."""
    return base64.b64encode(dumps(obj)).decode("ascii")
