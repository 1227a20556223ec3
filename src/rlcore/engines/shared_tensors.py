"""Weights handed to another process on this machine through shared memory, without a copy.

Two weight paths use it: SGLang's tensor mode (a rank hands a server on its machine handles to its
tensors) and the embedded engine's (a rank hands the driver, where that engine lives, handles to
the same tensors; the engine's one copy is into its model). Tensors already in shared memory (a
CPU rank's parameters, views of them, a stack's export buffers) go as they are; the others are
copied into one of a process's reusable shared buffers (:class:`SharedBuffers`), made once and
grown when needed, so that no sync faults in fresh pages. :func:`dumps` pickles such tensors as
handles (torch's ``file_system`` strategy: a file under ``/dev/shm`` and an offset), which the
receiver opens with :func:`pickle.loads`; pickling takes a reference on the memory and loading
releases it, so a payload must be loaded once.

This module imports torch; ``import rlcore`` does not import it.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Final, final

import torch
import torch.multiprocessing  # registers torch's pickling reductions with ForkingPickler

from rlcore.weights import on_release

__all__ = ["Named", "SharedBuffers", "dumps", "in_shared_memory", "tensor_bytes", "use_file_system"]

Named = tuple[str, torch.Tensor]
"""A weight: its Hugging Face name and the tensor."""

_ALIGN: Final = 64


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def in_shared_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a CPU tensor whose storage another process can map."""
    if tensor.is_cuda:
        return False
    shared: bool = tensor.is_shared()  # type: ignore[no-untyped-call]  # unannotated in torch
    return shared


def use_file_system() -> None:
    """Switch this process to torch's ``file_system`` sharing strategy: handles that are a file
    name, which a process with no connection to this one can open (with the default file
    descriptors, SGLang's scheduler dies; a Ray driver would need a socket to the rank)."""
    set_strategy = torch.multiprocessing.set_sharing_strategy
    set_strategy("file_system")  # type: ignore[no-untyped-call]  # unannotated in torch


def dumps(obj: object) -> bytes:
    """Pickle with torch's multiprocessing reductions: CPU tensors in shared memory as handles
    (:func:`use_file_system` first), CUDA tensors as CUDA IPC handles."""
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


@final
class SharedBuffers:
    """``slots`` growable shared-memory byte buffers of this process, reused sync after sync.

    :meth:`share` gives a list of weights as tensors another process can map: CPU tensors in
    shared memory as themselves, CUDA tensors as themselves with ``keep_cuda`` (for CUDA IPC) or
    else copied, and every other tensor copied into buffer ``slot``. A buffer's contents are
    valid until the next :meth:`share` into the same slot; :meth:`release` drops the buffers
    (and :func:`rlcore.weights.release_sender_resources` does, once one was made).
    """

    def __init__(self, slots: int) -> None:
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._lock = threading.Lock()

    @property
    def buffers(self) -> tuple[torch.Tensor | None, ...]:
        """The buffers made so far, by slot (``None``: not made)."""
        return tuple(self._buffers)

    def share(self, weights: Sequence[Named], slot: int, *, keep_cuda: bool) -> list[Named]:
        kept = [self._kept(t, keep_cuda) for _, t in weights]
        copied = [t for (_, t), keep in zip(weights, kept, strict=True) if not keep]
        offsets, total = _layout(copied)
        buffer: torch.Tensor | None = None
        if copied:
            with self._lock:
                buffer = self._buffers[slot]
                if buffer is None or buffer.numel() < total:
                    buffer = torch.empty(total, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]  # unannotated in torch
                    self._buffers[slot] = buffer
                    on_release(self.release)
        places = iter(offsets)
        out: list[Named] = []
        for (name, tensor), keep in zip(weights, kept, strict=True):
            if keep:
                out.append((name, tensor.contiguous() if tensor.is_cuda else tensor))
                continue
            assert buffer is not None  # allocated above: this tensor is copied
            offset, nbytes = next(places), tensor_bytes(tensor)
            view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            out.append((name, view))
        return out

    @staticmethod
    def _kept(tensor: torch.Tensor, keep_cuda: bool) -> bool:
        return keep_cuda if tensor.is_cuda else in_shared_memory(tensor)

    def release(self) -> None:
        """Drop the buffers (they are made again when needed)."""
        with self._lock:
            self._buffers = [None] * len(self._buffers)


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets: list[int] = []
    total = 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor_bytes(tensor) // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)
