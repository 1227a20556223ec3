"""What each rank of the two-process FSDP test runs (spawned: must be importable).

Rank r of 2 (gloo): one training step of a global batch of 4 (two samples per rank), the weights
sent to a sink that only rank 0 has, a checkpoint of both ranks' shards, and the log-probs after
the step (both ranks scoring all samples, then rank 0 three samples one at a time and rank 1
none); with ``lora_rank``, of LoRA adapters. Results go to ``out/rank<r>.pt`` for the parent
test to compare with one process; with ``resume_from``, the ranks then load a checkpoint that one
process saved and take the next step (:func:`resume`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlcore_fsdp.stacks import FSDPTrainingStack


def run(
    rank: int, world: int, port: int, hf: str, out: str, lora_rank: int = 0, resume_from: str = ""
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    import attrs

    from rlcore.specs import ParallelSpec
    from rlcore_fsdp.backend import FSDPBackend
    from rlcore_fsdp.options import FSDPOptions
    from tests.fsdp.test_two_ranks import batch_and_spec
    from tests.megatron.helpers import _Keep

    batch, spec = batch_and_spec(Path(hf))
    spec = attrs.evolve(
        spec, model=attrs.evolve(spec.model, parallel=ParallelSpec(world_size=world))
    )
    stack = FSDPBackend(FSDPOptions(lora_rank=lora_rank)).build_training_stack(spec)
    metrics = stack.train_step(batch)
    sink = _Keep()
    stack.send_weights([sink] if rank == 0 else [])
    stack.save(Path(out) / "ckpt", rollout_id=3)
    log_probs = stack.forward(list(batch.samples))
    # Shares that form 3 and 0 micro-batches: the ranks agree on 3 forward passes (#36).
    stack.forward_micro_batch = 1
    uneven = stack.forward(list(batch.samples)[:3] if rank == 0 else [])
    torch.save(
        {
            "loss": metrics.loss,
            "grad_norm": metrics.grad_norm,
            "extra": metrics.extra,
            "tokens": metrics.tokens,
            "sent": sink.tensors,
            # plain lists: torch.load (weights_only) takes no ForwardRows
            "log_probs": list(log_probs),
            "uneven": list(uneven),
        },
        Path(out) / f"rank{rank}.pt",
    )
    if resume_from:
        resume(rank, FSDPBackend().build_training_stack(spec), Path(resume_from), Path(out))
    torch.distributed.destroy_process_group()


def resume(rank: int, stack: FSDPTrainingStack, checkpoint: Path, out: Path) -> None:
    """Load ``checkpoint`` (saved by one process) into ``stack``, then take the step of
    :func:`tests.fsdp.test_two_ranks.next_batch`; rank 0 writes the full weights and optimizer
    state as loaded, the learning rate, and the weights after the step to ``out/resumed.pt``."""
    from tests.fsdp.test_two_ranks import full_optimizer_state, next_batch
    from tests.megatron.helpers import _Keep

    rollout_id = stack.load(checkpoint)
    loaded, stepped = _Keep(), _Keep()
    stack.send_weights([loaded] if rank == 0 else [])
    optimizer = full_optimizer_state(stack)
    lr = stack.optimizer.param_groups[0]["lr"]
    metrics = stack.train_step(next_batch())
    stack.send_weights([stepped] if rank == 0 else [])
    if rank == 0:
        torch.save(
            {
                "rollout_id": rollout_id,
                "loaded": loaded.tensors,
                "optimizer": optimizer,
                "lr": lr,
                "loss": metrics.loss,
                "stepped": stepped.tensors,
            },
            out / "resumed.pt",
        )
