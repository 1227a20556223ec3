"""Process-group initialisation for one Megatron rank.

:func:`init_megatron` is what every rank calls before building a stack, whether the process is a
plain script (a single rank by default), a ``torchrun`` worker or a Ray actor that already set up
``torch.distributed`` itself. It is idempotent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from rlcore.algorithms.distributed import device, init_process_group
from rlcore.errors import BackendUnavailableError
from rlcore_megatron import cpu

__all__ = ["device", "init_megatron", "shutdown_megatron"]


def init_megatron(tp_size: int = 1, seed: int = 1234, ep_size: int = 1) -> None:
    """Initialise ``torch.distributed`` (if nobody did), Megatron's parallel state and the seeds.

    ``torch.distributed`` comes from ``MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE`` when set (gloo on
    the CPU, nccl on GPUs), else a single process. On the CPU, :mod:`rlcore_megatron.cpu` is applied
    first. ``ep_size`` ranks share out a mixture-of-experts model's experts, each split over the
    ``tp_size`` ranks like a dense MLP (Megatron's default expert tensor parallel size). Seeds
    torch's CPU generator too, on every rank: CPU initialisation draws from it and Megatron's
    seeding does not touch it, so data-parallel replicas would otherwise start apart. Calling
    again with the same sizes only re-seeds; other sizes raise.
    """
    cpu.apply()
    init_process_group()
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if current != (tp_size, ep_size):
            raise BackendUnavailableError(
                f"Megatron is already initialised with tensor_model_parallel_size={current[0]} "
                f"and expert_model_parallel_size={current[1]}, asked for {tp_size} and "
                f"{ep_size}: one process holds one parallel layout "
                "(call shutdown_megatron() first, or use the same ParallelSpec for every stack)"
            )
    else:
        world = dist.get_world_size()
        for name, size in (
            ("tensor_model_parallel_size", tp_size),
            ("tensor_model_parallel_size x expert_model_parallel_size", tp_size * ep_size),
        ):
            if world % size:
                raise BackendUnavailableError(
                    f"ParallelSpec {name} = {size} does not divide the torch.distributed world "
                    f"size {world}"
                )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            expert_model_parallel_size=ep_size,
            expert_tensor_parallel_size=tp_size,
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not torch.cuda.is_available(), force_reset_rng=True
    )


def shutdown_megatron() -> None:
    """Tear down Megatron's parallel state and the process group (tests, or a changed layout)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
