"""The embedded engine's CPU decode attention: a C++ kernel built on first use, and the
transformers attention function that calls it.

A decode step's attention reads every cached key and value of every row once: at 512 answer
tokens in issue #13's workload that is 430 MB per step on average, and torch's SDPA reads it at
8-12 GB/s where this 2-core machine streams 20-30 GB/s. ``csrc/decode_attention.cpp`` reads the
keys in the blocked layout of :class:`~rlcore.engines.kv_cache.PreallocatedLayer` (``blocked_keys``)
and the values in order, each once (see the file's header). The kernel is fp32, CPU only, one query
position per row; it agrees with SDPA to float rounding (about 1e-6), not bit for bit.

It is compiled with ``torch.utils.cpp_extension`` (a C++17 compiler with OpenMP, g++ on Linux,
and ninja) into torch's extension cache (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) the first time an engine needs it: about 20 s once per machine and
torch version, then a load. Where it cannot be built, :func:`load_kernel` logs why once and returns
``None``, and the engine decodes with SDPA as before.

:data:`ATTENTION` is registered with transformers as an attention implementation that is SDPA
for everything except blocked keys, so a model switched to it behaves exactly as with ``sdpa``
wherever the engine's decode cache is not in use (prefill, a caller's own forward).

This module imports torch and transformers; ``import rlcore`` does not import it.
"""

from __future__ import annotations

import functools
import logging
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlcore.engines.kv_cache import unblock_keys

__all__ = ["ATTENTION", "Kernel", "build_kernel", "decode_attention_forward", "load_kernel"]

log = logging.getLogger("rlcore")

ATTENTION = "rlcore_decode"
"""The attention implementation's name (``model.set_attn_implementation(ATTENTION)``)."""

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"

Kernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor
]
"""``kernel(q, blocked_keys, values, mask, scale) -> Tensor[B, 1, H, D]``: ``q: Tensor[B, H, 1,
D]``, ``values: Tensor[B, KVH, L, D]``, ``mask: Tensor[B, L]`` (bool, True = attend) or ``None``."""


def build_kernel() -> Kernel:
    """Compile (or load the cached build of) the kernel and return it. Raises what the build
    raises (``RuntimeError`` with the compiler's output, ``OSError`` without a compiler)."""
    from torch.utils.cpp_extension import load

    load(
        name=_NAME,
        sources=[str(SOURCE)],
        extra_cflags=["-O3", "-fopenmp", "-Wno-psabi"],
        # torch's own OpenMP runtime (libgomp.so.1, already loaded) runs the kernel's threads.
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    kernel: Kernel = torch.ops.rlcore.decode_attention
    return kernel


# One cache entry per torch version: an extension built against another torch's headers must not
# be loaded by this one.
_NAME = "rlcore_decode_attention_" + re.sub(r"\W", "_", torch.__version__)


def _built_before() -> bool:
    """Whether torch's extension cache holds a build of the kernel (then loading it is quick)."""
    from torch.utils.cpp_extension import _get_build_directory

    return (Path(_get_build_directory(_NAME, verbose=False)) / f"{_NAME}.so").is_file()


@functools.cache
def load_kernel() -> Kernel | None:
    """The kernel, built on the first call in this process; ``None`` (with the reason logged) if it
    cannot be built here. Logs how long it took, and first that it is compiling when no earlier
    build is cached (a start-up stage of a run's first rollout: about 20 s)."""
    started = time.monotonic()
    cached = _built_before()
    if not cached:
        log.info(
            "decode kernel: compiling the CPU decode-attention kernel (once per machine and torch "
            "version, about 20 s)"
        )
    try:
        kernel = build_kernel()
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        log.warning(
            "rlcore: the CPU decode-attention kernel (%s) could not be built, so the embedded "
            "engine decodes with torch's SDPA (slower on long answers). Install a C++ compiler "
            "with OpenMP (g++) and ninja to use it. The build said: %s",
            SOURCE,
            exc,
        )
        return None
    elapsed = time.monotonic() - started
    log.info("decode kernel: %s (%.1f s)", "loaded" if cached else "compiled", elapsed)
    return kernel


def _kernel_mask(
    mask: torch.Tensor | None, batch: int, length: int
) -> tuple[bool, torch.Tensor | None]:
    """Whether the kernel takes transformers' attention ``mask``, and the ``Tensor[B, L]`` view it
    reads (``None``: attend everywhere). It takes none, or a boolean key mask shared by the heads
    and the query ``[B, 1, 1, L]``; not an additive or per-head one."""
    if mask is None:
        return True, None
    if mask.dtype == torch.bool and mask.shape == (batch, 1, 1, length):
        return True, mask[:, 0, 0, :]
    return False, None


def decode_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: SDPA, except that keys in the blocked layout
    (``Tensor[B, KVH, blocks, D, 16]`` from a ``blocked_keys`` cache) go to the kernel when it
    applies (one query position, fp32, no dropout, a key-padding mask at most), and are otherwise
    unblocked for SDPA. Returns ``(Tensor[B, S, H, D], None)``."""
    if key.dim() != 5:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    length = value.shape[2]
    takes_mask, mask = _kernel_mask(attention_mask, query.shape[0], length)
    kernel = load_kernel()
    if (
        kernel is not None
        and takes_mask
        and query.shape[2] == 1
        and dropout == 0.0
        and kwargs.get("position_bias") is None
        and query.dtype == key.dtype == value.dtype == torch.float32
    ):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return kernel(query, key, value, mask, scale), None
    return sdpa_attention_forward(
        module,
        query,
        unblock_keys(key, length),
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        **kwargs,
    )


AttentionInterface.register(ATTENTION, decode_attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
