"""What every weight sink is made of: the servers it posts to, and the buckets it sends.

A sink knows a server as a :class:`ServerRef` (URL, tensor-parallel size, the weight loader it
registered), a small value that pickles with the sink, and posts to it with :func:`post_ok_to`
under the engine's timeouts and retries. :func:`iter_buckets` cuts the weights into buckets of at
most ``bucket_bytes`` as they come, and :func:`version_fields` puts the new version and a cache
flush on the last request of a sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import final

import attrs
import torch

from rlcore.engines.shared_tensors import Named, tensor_bytes
from rlcore.weights import NamedTensors
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import CallPolicy, SGLangServer, post_ok

__all__ = ["Named", "ServerRef", "iter_buckets", "post_ok_to", "tensor_bytes", "version_fields"]


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


def post_ok_to(
    options: EngineOptions, ref: ServerRef, path: str, payload: dict[str, object]
) -> None:
    """POST ``payload`` to ``path`` on ``ref``'s server within the weight-sync timeout, retrying
    connection errors as the engine's options say; a :class:`~rlcore.errors.RolloutError` unless
    it answers with success."""
    post_ok(ref.server(), path, payload, options.weight_sync_timeout_s, _policy(options))


def iter_buckets(
    weights: NamedTensors, max_bytes: int, held: Callable[[torch.Tensor], int] = tensor_bytes
) -> Iterator[tuple[list[Named], bool]]:
    """``(bucket, is_last)``: consecutive runs of ``weights`` holding at most ``max_bytes`` (a
    larger tensor alone), read lazily with one bucket of look-ahead (to know which one is last).
    ``held``: the bytes a tensor holds while its bucket is in flight (default: its size)."""
    pending: list[Named] | None = None
    bucket: list[Named] = []
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


def version_fields(version: int, last: bool) -> dict[str, object]:
    """The fields of a sync's request that record ``version`` and flush the cache: set on the
    last request only."""
    return {"flush_cache": last, "weight_version": str(version) if last else None}
