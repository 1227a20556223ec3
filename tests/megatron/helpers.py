"""Batches and specs for the Megatron tests (plain functions; fixtures live in conftest)."""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import attrs
import torch

from rlcore.engines.hosts import free_port
from rlcore.protocols.stacks import Backend, EvalStack, ModelStack, TrainingStack
from rlcore.samples import Generation, Prompt, Sample, TrainBatch
from rlcore.specs import (
    EvalSpec,
    ISCorrection,
    LossSpec,
    LRSchedule,
    ModelSpec,
    OptimizerSpec,
    Precision,
    Role,
    TrainSpec,
)
from rlcore.weights import InProcess, NamedTensors

TINY: Final[dict[str, Any]] = {
    "vocab_size": 32,
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
}


TOKEN_MEAN_TIS: Final = LossSpec(agg_mode="token-mean", correction=ISCorrection(low=0.5, high=2.0))
"""A loss whose normaliser is the global batch's token count, with an importance correction."""


def make_samples(n: int, seed: int = 0, vocab: int = 32) -> list[Sample]:
    """``n`` samples with prompts of 2-5 tokens and responses of 1-6 tokens (ragged on purpose)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = (1, *(rng.randrange(3, vocab) for _ in range(rng.randint(1, 4))))
        response = tuple(rng.randrange(3, vocab) for _ in range(rng.randint(1, 6)))
        gen = Generation(response, tuple(-1.0 for _ in response), "", "stop")
        out.append(
            Sample(Prompt(i, "", prompt), gen, reward=float(rng.random() > 0.5), group=i // 2)
        )
    return out


def make_batch(
    samples: list[Sample],
    seed: int = 0,
    *,
    returns: bool = False,
    ref: bool = False,
    old: bool = False,
    rollout: bool = False,
    rollout_id: int = 0,
) -> TrainBatch:
    """A batch with random advantages (and returns / reference / old log-probs when asked;
    ``rollout``: the samples' engine log-probs, as the loop passes them)."""
    rng = random.Random(seed)

    def rows(scale: float, offset: float = 0.0) -> tuple[tuple[float, ...], ...]:
        return tuple(
            tuple(offset + scale * rng.uniform(-1, 1) for _ in s.response.token_ids)
            for s in samples
        )

    return TrainBatch(
        samples=tuple(samples),
        advantages=rows(1.0),
        returns=rows(1.0) if returns else (),
        ref_log_probs=rows(0.5, -3.0) if ref else (),
        old_log_probs=rows(0.5, -3.0) if old else (),
        rollout_id=rollout_id,
        rollout_log_probs=tuple(s.response.log_probs for s in samples) if rollout else (),
    )


def train_spec(
    hf: Path | None,
    role: Role = "actor",
    *,
    global_batch_size: int = 4,
    micro_batch_size: int = 2,
    steps_per_rollout: int = 1,
    schedule: LRSchedule | None = None,
    loss: LossSpec | None = None,
    clip_grad: float = 1.0,
    seed: int = 1234,
    precision: Precision = "float32",
    distributed_optimizer: bool = False,
) -> TrainSpec:
    return TrainSpec(
        model=ModelSpec(role=role, hf_checkpoint=hf, seed=seed, precision=precision),
        optimizer=OptimizerSpec(
            schedule=schedule or LRSchedule(lr=1e-3, min_lr=1e-4, warmup_steps=0, decay_steps=10),
            clip_grad=clip_grad,
            weight_decay=0.01,
            distributed=distributed_optimizer,
        ),
        loss=loss or LossSpec(),
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        steps_per_rollout=steps_per_rollout,
    )


def gradient_step_spec(hf: Path | None, **kwargs: Any) -> TrainSpec:
    """:func:`train_spec` with Adam at ``eps = 1`` and ``lr = 1``, which moves each weight by
    ``g / (|g| + 1)``: nearly the (clipped) gradient ``g`` itself for these small gradients, so
    the weights after one step compare gradients to the precision of the weights' change. Adam's
    usual first step, ``lr * sign(g)``, turns a gradient that is zero up to rounding into a whole
    step one way or the other, and a small ``lr`` hides gradient errors below the weights'
    rounding. Every backend's tests use it (``tests/conformance`` too); ``hf`` is ``None`` for a
    backend that builds its model from the spec alone."""
    schedule = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=0, decay_steps=10)
    spec = train_spec(hf, schedule=schedule, **kwargs)
    return attrs.evolve(spec, optimizer=attrs.evolve(spec.optimizer, adam_eps=1.0))


def assert_same_step(
    got: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, name: str
) -> None:
    """``got`` and ``expected`` took the same step from ``before``: to ``1e-4`` of the step, plus
    the rounding both steps took on landing in float32 weights of ``before``'s size (a layer
    norm's weights are near 1, where one rounding step is 1.2e-7), plus ``1e-5`` of the tensor's
    largest step. That last term is the gradient's own rounding: a weight's gradient is a sum over
    the batch's tokens, summed in another order when the batch is cut otherwise (micro-batches,
    ranks, a CPU's kernels), and where its terms cancel (a tied output row's softmax terms) it
    rounds by float32's eps times its terms, not times its small result (Qwen3-MoE's embedding
    under a token budget on an AVX2-only CPU: 1.7e-7 on a step of 4.8e-4, 4e-6 of the largest
    step)."""
    step = (expected - before).abs()
    landing = 2 * torch.finfo(torch.float32).eps * before.abs() + 1e-7
    off = (got - expected).abs() > 1e-4 * step + landing + 1e-5 * step.max()
    if off.any():
        worst = (got - expected).abs()[off].max().item()
        raise AssertionError(
            f"{name}: {int(off.sum())} of {off.numel()} weights off, by up to {worst:.3g}"
        )


def weights(named: Any) -> dict[str, torch.Tensor]:
    """Exported weights as detached copies (exports may be views of live parameters)."""
    return {name: t.detach().clone() for name, t in named}


def optimizer_parts(optimizer: object) -> list[Any]:
    """The Megatron optimizers inside the ``ChainedOptimizer`` that ``get_megatron_optimizer``
    returns (one for a dense model): ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` or
    ``DistributedOptimizer``, each stepping a torch optimizer held as ``.optimizer``."""
    parts: list[Any] = list(getattr(optimizer, "chained_optimizers"))  # noqa: B009
    return parts


def run_two_ranks(target: Callable[..., None], *args: object, timeout: float = 600) -> None:
    """Run ``target(rank, 2, port, *args)`` in two spawned processes (two gloo ranks) and wait;
    a rank left stuck in a collective after its peer died is killed."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, 2, port, *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    assert codes == [0, 0], f"rank exit codes {codes}: see the captured stderr for the traceback"


class _Keep:
    """An in-process sink that keeps detached copies of what it receives."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    @property
    def placement(self) -> InProcess:
        return InProcess()

    def receive(self, named: NamedTensors) -> None:
        self.tensors = weights(named)


def sent_weights(stack: ModelStack) -> dict[str, torch.Tensor]:
    """What ``stack`` sends an engine, as detached copies (any stack: through the protocol)."""
    keep = _Keep()
    stack.send_weights([keep])
    return keep.tensors


class RecordingBackend:
    """``inner`` (any backend) keeping the stacks it built, so a test can read their weights:
    the training stacks by role, the eval stacks in the order they were built."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.training: dict[str, TrainingStack] = {}
        self.eval_stacks: list[EvalStack] = []

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack:
        stack = self.inner.build_training_stack(spec)
        self.training[spec.model.role] = stack
        return stack

    def build_eval_stack(self, spec: EvalSpec) -> EvalStack:
        self.eval_stacks.append(self.inner.build_eval_stack(spec))
        return self.eval_stacks[-1]
