"""Test-only stand-in for SGLang's ``sgl_kernel`` (``sglang-kernel`` on PyPI) on a CPU-only host.

Not part of rlcore: ``nox -s sglang`` puts this folder on ``sys.path`` of its own virtualenv with a
``.pth`` file. The real package ships CUDA builds only; plain CPU generation in SGLang 0.5.x calls
exactly one of its kernels, :func:`assign_req_to_token_pool_cpu`, which is implemented here in
plain torch. Importing any other name succeeds (SGLang imports several at module level behind
platform checks) but calling it raises :class:`NotImplementedError` naming the kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch

__version__ = "0.0.0+rlcore.cpu.shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of ``req_to_token``.

    For request ``i`` (row ``req_pool_indices[i]``), positions ``start_offset[i]:end_offset[i]``
    receive the next ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``, which holds
    the slots of all requests back to back, in batch order (SGLang's Triton kernel
    ``assign_req_to_token_pool`` does the same on GPUs).
    """
    del pool_len  # the row length is req_to_token.shape[1]; kept for signature parity
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        count = end - start
        if count > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + count].to(
                req_to_token.dtype
            )
        offset += count


def _missing(name: str) -> Callable[..., NoReturn]:
    def kernel(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in rlcore's CPU test shim "
            "(tools/sglang_shims/sgl_kernel); only assign_req_to_token_pool_cpu is implemented. "
            "Install the real sglang-kernel on a CUDA host for other kernels."
        )

    kernel.__name__ = name
    return kernel


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
