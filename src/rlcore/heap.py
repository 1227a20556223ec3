"""The C heap of a rank that trains on the CPU: what glibc keeps resident after a tensor is freed.

A CPU tensor's memory comes from ``malloc``. glibc serves an allocation below its mmap threshold
from its heap, and that threshold rises to the size of the largest such block freed (up to
32 MiB), so after the first large free nearly every activation, gathered FSDP unit and optimizer
transient of a 100M model lives in the heap. A freed block in the middle of the heap stays in the
process's RSS until something reuses its pages, and in a forward pass that interleaves tensors
kept for the backward with transients, many never are: issue #36 measured 300-400 MiB of free
heap, all resident, at the end of a LoRA forward pass of a 110M Llama (4 x 128 tokens).

Allocator policy, so for CPU memory only: a GPU rank's tensors are not on the C heap. Backends
import these on demand (:mod:`ctypes`, no torch).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold", "release_freed_heap"]

MMAP_THRESHOLD_BYTES: Final = 4 << 20
"""The fixed glibc mmap threshold a CPU training rank sets (:func:`fix_mmap_threshold`): 4 MiB.
Larger blocks (gathered FSDP units, the logits and their gradients, a large model's activations)
are mapped for themselves and handed back when freed, where the risen threshold (up to 32 MiB)
would leave them in the heap. Lower thresholds keep no less resident in issue #36's LoRA step but
fault more pages in afresh (1 MiB: 1.2M minor page faults against 0.9M; glibc's default start,
128 KiB, more system time still)."""

_M_MMAP_THRESHOLD: Final = -3  # mallopt's parameter number (malloc.h)


def _libc_function(name: str) -> Callable[..., int] | None:
    """The C library's ``name``, or ``None`` when it has none (not glibc)."""
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(None), name)
    except (AttributeError, OSError, TypeError):  # not glibc; no C library by that name
        return None
    return function


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``; a no-op on
    other C libraries).

    glibc keeps the memory of a freed allocation below its mmap threshold (which rises to 32 MiB
    once such a block is freed) resident in its heap for the next ``malloc``: a CPU tensor freed
    in the middle of the heap stays in the process's RSS until something reuses its pages.
    """
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process (``mallopt``; what
    ``MALLOC_MMAP_THRESHOLD_`` sets from the environment), so that it no longer rises after a
    large block is freed: every block of ``threshold`` bytes and more is mapped on its own and
    handed back to the system when freed. Whether it was set (not on other C libraries)."""
    mallopt = _libc_function("mallopt")
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, threshold) == 1
