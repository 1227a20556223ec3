"""``torch.distributed`` as every backend's ranks use it: the process group (from the launcher's
environment, or one process), this rank's device, and the few collectives a train step and a
checkpoint share (the data-parallel all-reduce of a list of floats, a barrier, agreeing on the
rollout id a checkpoint loaded). A backend adds its own parallel state on top (Megatron's
tensor/expert groups); the data-parallel group is whatever group it passes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import torch
import torch.distributed as dist

from rlcore.algorithms.train_step import Reduce
from rlcore.errors import BackendUnavailableError, CheckpointError

__all__ = [
    "agree_on_rollout_id",
    "all_reduce_floats",
    "barrier",
    "device",
    "init_process_group",
    "rank",
]

_ENV_VARS: Final = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def device() -> torch.device:
    """Where this rank's model lives: its CUDA device, or the CPU when there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor for a collective over ``group`` must lie: the CPU when the group's
    backend takes CPU tensors (gloo, or gloo beside nccl), else this rank's GPU (nccl alone)."""
    if torch.cuda.is_available() and "gloo" not in str(dist.get_backend(group)):
        return device()
    return torch.device("cpu")


def init_process_group(cpu_collectives: bool = False) -> None:
    """Join the process group unless this process already has: from ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK`` and ``WORLD_SIZE`` when set (what a launcher sets on each rank),
    else one process of its own (an in-memory store, no port to pick). gloo on the CPU, nccl on
    GPUs (each rank on the GPU ``LOCAL_RANK`` names); ``cpu_collectives``: on GPUs, gloo too for
    collectives over CPU tensors (what offloaded weights and gradients need)."""
    if dist.is_initialized():
        return
    backend = "gloo"
    if torch.cuda.is_available():
        backend = "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"
    if all(v in os.environ for v in _ENV_VARS):
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method="env://")
        return
    missing = [v for v in _ENV_VARS if v not in os.environ]
    if len(missing) != len(_ENV_VARS):
        raise BackendUnavailableError(
            f"torch.distributed environment incomplete: {', '.join(missing)} unset "
            f"(set all of {', '.join(_ENV_VARS)} for a multi-rank run, or none for one process)"
        )
    # HashStore is exported at runtime but absent from torch.distributed's __all__.
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group(backend, store=store, rank=0, world_size=1)


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """Wait for every rank (nothing to wait for on one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_floats(
    op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None = None
) -> Reduce:
    """An all-reduce of a list of floats over ``group`` (the default group for ``None``), in
    float64: the reduction :meth:`rlcore.algorithms.train_step.StepMetrics.reduce` takes."""

    def reduce(values: list[float]) -> list[float]:
        reduced = torch.tensor(values, dtype=torch.float64, device=_collective_device(group))
        dist.all_reduce(reduced, op=op, group=group)
        out: list[float] = reduced.tolist()
        return out

    return reduce


def agree_on_rollout_id(path: Path, rollout_id: int) -> None:
    """Raise :class:`~rlcore.errors.CheckpointError` unless every rank loaded ``rollout_id``
    from ``path`` (a collective: every rank calls it)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    ids = torch.tensor(
        [rollout_id, -rollout_id], dtype=torch.int64, device=_collective_device(None)
    )
    dist.all_reduce(ids, op=dist.ReduceOp.MAX)
    if int(ids[0]) != -int(ids[1]):
        raise CheckpointError(
            f"ranks disagree on the rollout id loaded from {path}: rank {rank()} read "
            f"{rollout_id}, others between {-int(ids[1])} and {int(ids[0])} "
            "(every rank must load the same checkpoint)"
        )
