"""The ``[optim]`` and ``[train]`` sections: AdamW and its learning-rate schedule, and how a
rollout's samples are cut into optimizer steps and micro-batches; with the invariants a training
run needs of them (:func:`optimizer_problems`, :func:`batch_problems`,
:func:`schedule_problems`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from rlcore.config.fields import option, problem
from rlcore.config.rollout import RolloutConfig
from rlcore.errors import ConfigProblem
from rlcore.specs import (
    DecayStyle,
    batch_split_problem,
    parallel_split_problem,
    schedule_length_problem,
)

__all__ = [
    "OptimizerConfig",
    "TrainConfig",
    "batch_problems",
    "optimizer_problems",
    "schedule_problems",
    "train_size_problems",
]


@attrs.frozen
class OptimizerConfig:
    """AdamW and its learning-rate schedule (in optimizer steps)."""

    lr: float = option(1e-6, "--lr", "peak learning rate")
    critic_lr: float | None = option(None, "--critic-lr", "critic learning rate (default: --lr)")
    min_lr: float = option(0.0, "--min-lr", "learning rate at the end of decay")
    lr_warmup_iters: int = option(0, "--lr-warmup-iters", "linear warmup steps")
    lr_decay_iters: int | None = option(
        None, "--lr-decay-iters", "decay steps (default: all optimizer steps of the run)"
    )
    lr_decay_style: DecayStyle = option(
        "constant", "--lr-decay-style", "constant, linear, cosine, inverse-square-root"
    )
    clip_grad: float = option(1.0, "--clip-grad", "global gradient-norm clip (0 = off)")
    weight_decay: float = option(0.0, "--weight-decay", "AdamW weight decay")
    adam_beta1: float = option(0.9, "--adam-beta1", "AdamW beta1")
    adam_beta2: float = option(0.999, "--adam-beta2", "AdamW beta2")
    use_distributed_optimizer: bool = option(
        False,
        "--use-distributed-optimizer",
        "shard optimizer state and fp32 main weights over data-parallel ranks (ZeRO-1)",
    )


@attrs.frozen
class TrainConfig:
    """How a rollout's samples are cut into optimizer steps and micro-batches."""

    global_batch_size: int = option(32, "--global-batch-size", "samples per optimizer step")
    micro_batch_size: int = option(8, "--micro-batch-size", "samples per forward/backward per rank")
    use_dynamic_batch_size: bool = option(
        False,
        "--use-dynamic-batch-size",
        "cut micro-batches by a token budget (--max-tokens-per-gpu) instead of "
        "--micro-batch-size samples",
    )
    max_tokens_per_gpu: int | None = option(
        None,
        "--max-tokens-per-gpu",
        "with --use-dynamic-batch-size: tokens per train micro-batch per rank, counted padded "
        "to the micro-batch's longest sequence (a longer sequence gets a micro-batch of its own)",
    )
    log_probs_max_tokens_per_gpu: int | None = option(
        None,
        "--log-probs-max-tokens-per-gpu",
        "with --use-dynamic-batch-size: the same for the forward-only passes (log-probs, "
        "values, teacher) (default: --max-tokens-per-gpu)",
    )

    @property
    def train_token_budget(self) -> int | None:
        """The train step's tokens per micro-batch, or ``None`` (micro-batches by sample count)."""
        return self.max_tokens_per_gpu if self.use_dynamic_batch_size else None

    @property
    def log_probs_token_budget(self) -> int | None:
        """The forward-only passes' tokens per micro-batch, or ``None``."""
        if not self.use_dynamic_batch_size:
            return None
        return self.log_probs_max_tokens_per_gpu or self.max_tokens_per_gpu


def train_size_problems(t: TrainConfig) -> list[ConfigProblem]:
    """Batch sizes are at least 1; a token budget is positive, given with
    ``--use-dynamic-batch-size`` and only with it."""
    problems = [
        problem(TrainConfig, "train", name, f"must be >= 1, got {getattr(t, name)}")
        for name in ("global_batch_size", "micro_batch_size")
        if getattr(t, name) < 1
    ]
    budgets = ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu")
    for name in budgets:
        value = getattr(t, name)
        if value is not None and value < 1:
            problems.append(problem(TrainConfig, "train", name, f"must be >= 1, got {value}"))
        elif value is not None and not t.use_dynamic_batch_size:
            problems.append(
                problem(
                    TrainConfig,
                    "train",
                    name,
                    "a token budget is only used with --use-dynamic-batch-size",
                    "add --use-dynamic-batch-size, or drop the budget",
                    reads=("train.use_dynamic_batch_size",),
                )
            )
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        problems.append(
            problem(
                TrainConfig,
                "train",
                "max_tokens_per_gpu",
                "--use-dynamic-batch-size needs a token budget",
                "add --max-tokens-per-gpu N (tokens per micro-batch per rank, e.g. the longest "
                "prompt + response times the sequences you want per micro-batch)",
                reads=("train.use_dynamic_batch_size",),
            )
        )
    return problems


def optimizer_problems(o: OptimizerConfig) -> list[ConfigProblem]:
    """Learning rates, the gradient clip and the warmup in range (for a training run)."""
    problems: list[ConfigProblem] = []

    def add(name: str, message: str) -> None:
        problems.append(problem(OptimizerConfig, "optim", name, message))

    if o.lr <= 0:
        add("lr", f"must be > 0, got {o.lr}")
    if o.critic_lr is not None and o.critic_lr <= 0:
        add("critic_lr", f"must be > 0, got {o.critic_lr}")
    if not 0 <= o.min_lr <= max(o.lr, o.critic_lr or 0.0):
        add("min_lr", f"must be in [0, lr], got {o.min_lr}")
    if o.clip_grad < 0:
        add("clip_grad", f"must be >= 0, got {o.clip_grad}")
    if o.lr_warmup_iters < 0:
        add("lr_warmup_iters", f"must be >= 0, got {o.lr_warmup_iters}")
    return problems


def batch_problems(
    t: TrainConfig,
    r: RolloutConfig,
    tensor_parallel: int,
    ranks_by_role: Mapping[str, int],
    pipeline_parallel: int = 1,
) -> list[ConfigProblem]:
    """A rollout's samples split into whole global batches, a global batch keeps each prompt's
    group together, and splits into whole micro-batches on every data-parallel rank of every
    trained model (``ranks_by_role``; a model's data-parallel ranks are its ranks over its
    tensor and pipeline parallel sizes)."""
    problems: list[ConfigProblem] = []

    def add(name: str, message: str, hint: str, reads: tuple[str, ...]) -> None:
        problems.append(problem(TrainConfig, "train", name, message, hint, reads=reads))

    samples = r.rollout_batch_size * r.n_samples_per_prompt
    sampling = ("rollout.rollout_batch_size", "rollout.n_samples_per_prompt")
    if t.global_batch_size >= 1 and samples >= 1:
        if samples < t.global_batch_size:
            add(
                "global_batch_size",
                f"{t.global_batch_size} is more than the {samples} samples a rollout makes "
                f"(rollout_batch_size x n_samples_per_prompt), so no optimizer step would run",
                "lower --global-batch-size or raise --rollout-batch-size",
                sampling,
            )
        elif samples % t.global_batch_size:
            add(
                "global_batch_size",
                f"does not divide the {samples} samples per rollout",
                "pick a divisor",
                sampling,
            )
        if (
            r.rollout_batch_size >= 1
            and r.n_samples_per_prompt >= 1
            and t.global_batch_size % r.n_samples_per_prompt
        ):
            add(
                "global_batch_size",
                f"{t.global_batch_size} splits a prompt's group of "
                f"{r.n_samples_per_prompt} samples",
                "use a multiple of --n-samples-per-prompt",
                sampling[1:],
            )
    tp, pp = tensor_parallel, pipeline_parallel
    sizes_valid = min(t.global_batch_size, t.micro_batch_size, tp, pp) >= 1
    for role, ranks in ranks_by_role.items():
        if sizes_valid and ranks >= 1 and not parallel_split_problem(tp, ranks, pp):
            # TrainSpec's own rule, so that a config that passes plans into valid TrainSpecs.
            data = ranks // (tp * pp)
            split = batch_split_problem(t.global_batch_size, t.micro_batch_size, data)
            if split:
                add("micro_batch_size", f"the {role}'s {split}", "pick sizes that divide", ())
    return problems


def schedule_problems(
    o: OptimizerConfig, decay_steps: int, reads: Sequence[str]
) -> list[ConfigProblem]:
    """LRSchedule's own rule, applied to the ``decay_steps`` the plan will give it (``reads``:
    the fields they come from, when not ``--lr-decay-iters``)."""
    length = schedule_length_problem(o.lr_warmup_iters, decay_steps)
    if length and length[0] == "decay_steps":
        return [
            problem(
                OptimizerConfig,
                "optim",
                "lr_decay_iters",
                f"the run would decay the LR over {decay_steps} optimizer steps: {length[1]}",
                "give --lr-decay-iters or train more samples",
                reads=reads,
            )
        ]
    if length:
        return [
            problem(
                OptimizerConfig,
                "optim",
                "lr_warmup_iters",
                f"warmup ({o.lr_warmup_iters}) must be shorter than decay ({decay_steps} steps)",
                "lower --lr-warmup-iters or raise --lr-decay-iters",
                reads=("optim.lr_decay_iters", *reads),
            )
        ]
    return []
