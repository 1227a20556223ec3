"""Weights handed to another process on this machine through shared memory, without a copy.

Two weight paths use it: SGLang's tensor mode (a rank hands a server on its machine handles to its
tensors, pickled by :func:`dumps`) and the embedded engine's (a rank hands the driver, where that
engine lives, :class:`SharedTensor` s that name the files its tensors are in, and the driver maps
them with :class:`Mappings`; the engine's one copy is into its model). Tensors already in shared
memory (a CPU rank's parameters, views of them, a stack's export buffers) go as they are; the
others are copied into one of a process's reusable shared buffers (:class:`SharedBuffers`), made
once and grown when needed, so that no sync faults in fresh pages.

Shared memory here is torch's ``file_system`` strategy (:func:`use_file_system`): a file under
``/dev/shm`` per storage, its data after a 64-byte header (the reference count that lets the last
process that maps it through torch remove it). A handle pickled by :func:`dumps` takes a reference
on the memory and loading it releases one, so such a payload must be loaded once; it also ties
the loading process to the sender's ``torch_shm_manager``, which later shared memory of the
loading process may then be registered with. :class:`Mappings` does neither: it maps the files
with plain ``mmap`` (the sender's storages stay the sender's to free; a mapping keeps its memory
until it is dropped), which is what a long-lived driver that outlives its ranks needs.

This module imports torch; ``import rlcore`` does not import it.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import threading
import weakref
from collections.abc import Iterable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Final, final

import attrs
import torch
import torch.multiprocessing  # registers torch's pickling reductions with ForkingPickler

from rlcore.engines._shm import SHM_DIR
from rlcore.errors import RolloutError
from rlcore.weights import on_release

__all__ = [
    "TRIM_EVERY_BYTES",
    "ExportBuffers",
    "Mappings",
    "Named",
    "SharedBuffers",
    "SharedTensor",
    "describe",
    "dumps",
    "in_shared_memory",
    "is_shared_parameter",
    "release_freed_heap",
    "share_cpu_tensors",
    "tensor_bytes",
    "use_file_system",
]

Named = tuple[str, torch.Tensor]
"""A weight: its Hugging Face name and the tensor."""

_ALIGN: Final = 64
_HEADER: Final = 64
"""Bytes before a ``file_system`` storage's data in its file (torch's ``map_alloc_alignment``)."""


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


TRIM_EVERY_BYTES = 64 * 2**20
"""How much tensor memory :func:`share_cpu_tensors` frees between two :func:`release_freed_heap`
calls: what its peak holds above the tensors, besides the tensor being moved."""


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; a no-op on
    other C libraries).

    glibc keeps the memory of a freed allocation below its mmap threshold (which rises to 32 MiB
    once such a block is freed) resident in its heap for the next ``malloc``: a CPU tensor freed
    in the middle of the heap stays in the process's RSS until something reuses its pages.
    """
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError, TypeError):  # not glibc; no C library by that name
        return
    trim(0)


def share_cpu_tensors(tensors: Iterable[torch.Tensor]) -> None:
    """Move CPU tensors (a CPU rank's parameters, or their local shards) into shared memory, in
    place (every view of their storages sees it; :func:`use_file_system` first), before an
    optimizer holds them.

    A weight sync to a process on this machine then hands it the live parameters
    (:meth:`SharedBuffers.share` keeps them as they are), as CUDA IPC handles do on GPUs, instead
    of first copying every tensor into a shared buffer: the receiver's copy into its own weights
    is the only one.

    The memory used stays that of the tensors: each storage is copied into a shared mapping and
    its heap memory freed, and glibc would keep those freed pages resident (nearly the weights a
    second time: all but the tensors over 32 MiB, about 3 of the 4 bytes per parameter of a 100M
    fp32 Llama, issue #23), so they are handed back to the system as the move goes
    (:func:`release_freed_heap`), together with what building the model freed.
    """
    use_file_system()
    release_freed_heap()
    freed = 0
    for tensor in tensors:
        if not in_shared_memory(tensor):  # else a view of a storage moved already (or before)
            freed += tensor.untyped_storage().nbytes()
            tensor.share_memory_()  # type: ignore[no-untyped-call]  # unannotated in torch
        _remember(tensor.untyped_storage())
        if freed >= TRIM_EVERY_BYTES:
            release_freed_heap()
            freed = 0
    if freed:
        release_freed_heap()


_PARAMETERS: dict[int, weakref.ref[torch.UntypedStorage]] = {}
"""The storages :func:`share_cpu_tensors` put parameters in, by address."""


def _remember(storage: torch.UntypedStorage) -> None:
    address = storage.data_ptr()

    def forget(ref: weakref.ref[torch.UntypedStorage]) -> None:
        if _PARAMETERS.get(address) is ref:
            del _PARAMETERS[address]

    _PARAMETERS[address] = weakref.ref(storage, forget)


def is_shared_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is (a view of) parameters that :func:`share_cpu_tensors` moved into
    shared memory, in storage that is still theirs: a training step changes it in place, so
    where it lies stays true after the step (an export buffer, a gathered copy, or a cast lies
    elsewhere each time, or holds the previous export's values)."""
    if tensor.is_cuda:
        return False
    storage = tensor.untyped_storage()
    ref = _PARAMETERS.get(storage.data_ptr())
    return ref is not None and ref() is storage


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
        return keep_cuda if tensor.is_cuda else file_of(tensor) is not None

    def release(self) -> None:
        """Drop the buffers (they are made again when needed)."""
        with self._lock:
            self._buffers = [None] * len(self._buffers)


@final
class ExportBuffers:
    """Where a stack's weight export lays out, on the CPU, the tensors it cannot give as views of
    the parameters (Megatron's q, k and v split out of a fused QKV; the bf16 casts of fp32
    weights): one tensor per HF name, reused export after export, in shared memory.

    Reused, so that no sync allocates and faults in fresh pages; shared, like a CPU rank's
    parameters (:func:`share_cpu_tensors`), so that a sink on this machine (the embedded engine,
    a tensor-mode SGLang server) is handed them without a copy, and the server, which keeps its
    mappings (:mod:`rlcore_sglang.server_loader`), finds them mapped already. Costs the size of
    those tensors for as long as the stack lives. CUDA tensors are made fresh: the caching
    allocator already reuses their memory, and training needs it in between.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}

    def materialise(
        self,
        name: str,
        view: torch.Tensor,
        shape: tuple[int, ...],
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``view``'s elements as a tensor of ``shape`` and ``dtype`` (``view``'s by default);
        on the CPU it is this name's buffer, valid until the next export."""
        dtype = view.dtype if dtype is None else dtype
        if view.device.type != "cpu":
            return view.reshape(shape).to(dtype)
        buffer = self._tensors.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = torch.empty(shape, dtype=dtype)
            buffer.share_memory_()  # type: ignore[no-untyped-call]  # unannotated in torch
            self._tensors[name] = buffer
        buffer.view(view.shape).copy_(view)
        return buffer


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets: list[int] = []
    total = 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor_bytes(tensor) // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


@final
@attrs.frozen
class SharedTensor:
    """Where a tensor of another process lies in shared memory: a picklable description."""

    name: str
    """Its Hugging Face name."""
    file: str
    """The shared-memory name of its storage's file (``/torch_<pid>_...``)."""
    offset: int
    """Bytes from the file's start to the tensor's storage offset."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def file_of(tensor: torch.Tensor) -> str | None:
    """The shared-memory name of a CPU tensor's storage, if it is shared by file name."""
    if not in_shared_memory(tensor):
        return None
    try:
        _, handle, _ = tensor.untyped_storage()._share_filename_cpu_()
    except RuntimeError:  # shared by file descriptor: nothing another process can open by name
        return None
    return handle.decode() if isinstance(handle, bytes) else str(handle)


def describe(weights: Sequence[Named]) -> list[SharedTensor]:
    """Each tensor of ``weights`` (all shared by file name: :meth:`SharedBuffers.share` with
    :func:`use_file_system` first) as a :class:`SharedTensor`."""
    out = []
    for name, tensor in weights:
        file = file_of(tensor)
        if file is None:
            raise ValueError(f"{name} is not in shared memory by file name")
        out.append(
            SharedTensor(
                name,
                file,
                _HEADER + int(tensor.storage_offset()) * tensor.element_size(),
                tensor.dtype,
                tuple(tensor.shape),
                tuple(tensor.stride()),
            )
        )
    return out


@final
class Mappings:
    """This process's mappings of another process's shared-memory files, kept from one
    :meth:`open` to the next (a fresh mapping would fault every page in again)."""

    def __init__(self) -> None:
        self._files: dict[str, torch.Tensor] = {}

    def open(self, described: Sequence[SharedTensor]) -> list[Named]:
        """The described tensors, as views of the mapped files (valid while the sender leaves
        them as they are). Files this call does not use are no longer mapped here.

        Raises :class:`~rlcore.errors.RolloutError` when a file is gone (its process freed it).
        """
        files: dict[str, torch.Tensor] = {}
        out: list[Named] = []
        for d in described:
            whole = files.get(d.file)
            if whole is None:
                whole = self._files.get(d.file)
                if whole is None:
                    whole = _map(d.file)
                files[d.file] = whole
            size = torch.empty((), dtype=d.dtype).element_size()
            typed = whole[: whole.numel() - whole.numel() % size].view(d.dtype)
            out.append((d.name, typed.as_strided(d.shape, d.stride, d.offset // size)))
        self._files = files
        return out

    def close(self) -> None:
        """Drop every mapping (their memory is freed once nothing else maps it)."""
        self._files = {}


def _map(file: str) -> torch.Tensor:
    path = SHM_DIR + file
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise RolloutError(
            f"cannot map {path}, where a rank's weights were ({exc}): the rank freed or lost it "
            "before the engine copied them; is the rank still running?"
        ) from exc
    try:
        mapping = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8)
