"""What each rank of the two-process family test runs (spawned: must be importable).

Rank r of 2, for every family in ``folders``: first tensor parallel 2 (logits, the gathered export,
one training step), then, for the mixture-of-experts model, expert parallel 2 (the experts split
over both ranks, which are also two data-parallel replicas): logits, export, a training step with
the router's load-balancing loss, and a checkpoint saved and loaded. Results go to
``out/<name>.rank<r>.pt`` for the parent test to compare with one process and with transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

TOKENS_SEED = 7


def tokens(vocab: int) -> torch.Tensor:
    """The random ids every rank and the parent score (``[3, 11]``: 11 is odd, so sequence
    parallelism over 2 ranks has to pad)."""
    return torch.randint(0, vocab, (3, 11), generator=torch.Generator().manual_seed(TOKENS_SEED))


def logits(stack: Any, ids: torch.Tensor) -> torch.Tensor:
    """A stack's logits ``[B, S, vocab]`` for ``ids`` (each row scored as one sample), through
    the stacks' own forward (which pads the sequence for sequence parallelism)."""
    from rlcore.algorithms.batching import tensorize_samples
    from rlcore.samples import Generation, Prompt, Sample
    from rlcore_megatron.stacks import model_output

    rows = ids.tolist()
    samples = [
        Sample(
            Prompt(i, "", tuple(row[:1])),
            Generation(tuple(row[1:]), tuple(0.0 for _ in row[1:]), "", "length"),
            reward=0.0,
            group=i,
        )
        for i, row in enumerate(rows)
    ]
    batch = tensorize_samples(samples, stack.arch.pad_token_id)
    assert torch.equal(batch.tokens, ids)
    with torch.no_grad():
        return model_output(stack.model, batch, stack.arch, False).clone()


def family_train_spec(folder: Path, parallel: Any = None) -> Any:
    """The training spec both the ranks and the one-process reference use: the helpers'
    :func:`~tests.megatron.helpers.gradient_step_spec` with the router's load-balancing loss on."""
    import attrs

    from tests.megatron.helpers import gradient_step_spec

    spec = gradient_step_spec(folder)
    model = attrs.evolve(spec.model, moe_aux_loss_coeff=0.01)
    if parallel is not None:
        model = attrs.evolve(model, parallel=parallel)
    return attrs.evolve(spec, model=model)


def run(rank: int, world: int, port: int, folders: dict[str, str], out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from rlcore.specs import EvalSpec, ModelSpec, ParallelSpec
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.parallel import init_megatron, shutdown_megatron
    from tests.megatron.helpers import make_batch, make_samples, weights

    results = Path(out)
    backend = MegatronBackend()
    batch = make_batch(make_samples(4, seed=21), seed=22)

    def run_layout(name: str, parallel: ParallelSpec, families: dict[str, str]) -> None:
        init_megatron(parallel.tensor, 1234, parallel.expert)
        found: dict[str, Any] = {}
        for family, folder in families.items():
            ev = backend.build_eval_stack(
                EvalSpec(ModelSpec("actor", Path(folder), parallel=parallel))
            )
            stack = backend.build_training_stack(family_train_spec(Path(folder), parallel))
            metrics = stack.train_step(batch)
            found[family] = {
                "logits": logits(ev, tokens(ev.arch.vocab_size)),
                "exported": weights(ev.export_weights()),
                "trained": weights(stack.export_weights()),
                "grad_norm": metrics.grad_norm,
                "extra": dict(metrics.extra),
            }
            if parallel.expert > 1:
                stack.save(results / f"{name}_ckpt", rollout_id=3)
                found[family]["loaded"] = stack.load(results / f"{name}_ckpt")
                found[family]["reloaded"] = weights(stack.export_weights())
            del ev, stack
        torch.save(found, results / f"{name}.rank{rank}.pt")
        parallel_state.destroy_model_parallel()

    run_layout("tp2", ParallelSpec(tensor=2, world_size=2), folders)
    experts = {f: p for f, p in folders.items() if f == "qwen3_moe"}
    run_layout("ep2", ParallelSpec(world_size=2, expert=2), experts)
    shutdown_megatron()
