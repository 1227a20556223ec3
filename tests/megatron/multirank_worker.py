"""What each rank of the two-process Megatron test runs (spawned: must be importable).

Rank r of 2: first tensor parallel 2 (one model split over both ranks), then data parallel 2
(two replicas), then data parallel 2 in bf16 with the distributed optimizer (each rank holds half
of the fp32 main weights and Adam state). Results go to ``out/<name>.rank<r>.pt`` for the parent
test to compare.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def run(rank: int, world: int, port: int, hf: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from rlcore.errors import CheckpointError
    from rlcore.specs import EvalSpec, ModelSpec, ParallelSpec
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.parallel import init_megatron, shutdown_megatron
    from tests.megatron.helpers import (
        gradient_step_spec,
        make_batch,
        make_samples,
        optimizer_parts,
        train_spec,
        weights,
    )

    folder, results = Path(hf), Path(out)
    backend = MegatronBackend()
    samples = make_samples(4, seed=21)
    batch = make_batch(samples, seed=22)

    # tensor parallel 2
    init_megatron(tp_size=2, seed=1234)
    tp2 = ParallelSpec(tensor=2, world_size=2)
    ev = backend.build_eval_stack(EvalSpec(ModelSpec("actor", folder, parallel=tp2)))
    exported = weights(ev.export_weights())
    from rlcore_megatron.model.hf_weights import save_hf

    save_hf(ev, results / "tp2_hf", ev.arch)  # collective export, rank 0 writes
    log_probs = ev.forward(samples)
    bf16_log_probs = backend.build_eval_stack(
        EvalSpec(ModelSpec("actor", folder, parallel=tp2, precision="bfloat16"))
    ).forward(samples)
    import attrs

    spec = gradient_step_spec(folder)
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, parallel=tp2))
    stack = backend.build_training_stack(spec)
    metrics = stack.train_step(batch)
    stack.save(results / "tp2_ckpt", rollout_id=4)
    loaded = stack.load(results / "tp2_ckpt")
    torch.save(
        {
            "exported": exported,
            # plain lists: torch.load (weights_only) takes no ForwardRows
            "log_probs": list(log_probs),
            "bf16_log_probs": list(bf16_log_probs),
            "trained": weights(stack.export_weights()),
            "grad_norm": metrics.grad_norm,
            "loaded": loaded,
        },
        results / f"tp2.rank{rank}.pt",
    )
    del ev, stack
    parallel_state.destroy_model_parallel()

    # data parallel 2
    init_megatron(tp_size=1, seed=1234)
    dp2 = ParallelSpec(tensor=1, world_size=2)
    spec = gradient_step_spec(folder)
    stack = backend.build_training_stack(
        attrs.evolve(spec, model=attrs.evolve(spec.model, parallel=dp2))
    )
    metrics = stack.train_step(batch)
    stack.save(results / "dp2_a", rollout_id=1)
    stack.save(results / "dp2_b", rollout_id=2)
    try:
        stack.load(results / ("dp2_a" if rank == 0 else "dp2_b"))
        disagreement = ""
    except CheckpointError as exc:
        disagreement = str(exc)
    torch.save(
        {
            "trained": weights(stack.export_weights()),
            "grad_norm": metrics.grad_norm,
            "loss": metrics.loss,
            "tokens": metrics.tokens,
            "disagreement": disagreement,
        },
        results / f"dp2.rank{rank}.pt",
    )
    del stack

    # data parallel 2, bf16 with the distributed optimizer: two steps straight, and one step,
    # save, a fresh stack, load, one step
    bf16 = attrs.evolve(
        train_spec(folder, precision="bfloat16", distributed_optimizer=True),
        model=attrs.evolve(spec.model, parallel=dp2, precision="bfloat16"),
    )
    second = make_batch(make_samples(4, seed=23), seed=24)
    straight = backend.build_training_stack(bf16)
    first_metrics = straight.train_step(batch)
    one_step = weights(straight.export_weights())
    straight.save(results / "dp2_zero1", rollout_id=0)
    straight.train_step(second)
    resumed = backend.build_training_stack(bf16)
    resumed.load(results / "dp2_zero1")
    resumed.train_step(second)
    torch.save(
        {
            "one_step": one_step,
            "grad_norm": first_metrics.grad_norm,
            "straight": weights(straight.export_weights()),
            "resumed": weights(resumed.export_weights()),
            "optimizer": [type(part).__name__ for part in optimizer_parts(straight.optimizer)],
        },
        results / f"dp2_zero1.rank{rank}.pt",
    )
    del straight, resumed

    # data parallel 2, token-mean loss with a TIS correction: the normaliser is the global token
    # count, and the metrics are the global batch's
    from tests.megatron.helpers import TOKEN_MEAN_TIS

    spec = gradient_step_spec(folder, loss=TOKEN_MEAN_TIS)
    stack = backend.build_training_stack(
        attrs.evolve(spec, model=attrs.evolve(spec.model, parallel=dp2))
    )
    metrics = stack.train_step(make_batch(samples, seed=22, rollout=True))
    torch.save(
        {
            "trained": weights(stack.export_weights()),
            "grad_norm": metrics.grad_norm,
            "loss": metrics.loss,
            "extra": dict(metrics.extra),
        },
        results / f"dp2_token.rank{rank}.pt",
    )
    del stack

    # the same by a token budget: ranks take length-balanced shares (not contiguous halves), cut
    # into micro-batches of at most 8 padded tokens, as many on each rank
    stack = backend.build_training_stack(
        attrs.evolve(spec, model=attrs.evolve(spec.model, parallel=dp2), max_tokens_per_gpu=8)
    )
    metrics = stack.train_step(make_batch(samples, seed=22, rollout=True))
    torch.save(
        {
            "trained": weights(stack.export_weights()),
            "grad_norm": metrics.grad_norm,
            "loss": metrics.loss,
            "extra": dict(metrics.extra),
        },
        results / f"dp2_budget.rank{rank}.pt",
    )
    shutdown_megatron()
