"""The run configuration as one value: :class:`RunConfig`, the sections it holds, and
:func:`check`, which composes the sections' checks with the few that span sections.

A :class:`RunConfig` that exists is valid: its constructor checks every invariant that would
otherwise fail later inside Megatron or mid-run and raises one :class:`~rlcore.errors.ConfigError`
listing *all* problems with their field paths (and flags) and what to do. Every ``float`` field
must be a finite number (no field gives NaN or infinity a meaning).
"""

from __future__ import annotations

import functools
import math
import typing
from pathlib import Path
from typing import Any

import attrs

from rlcore.config.algorithm import AlgorithmConfig, algorithm_problems
from rlcore.config.checkpoint import (
    CheckpointConfig,
    DebugConfig,
    checkpoint_problems,
    debug_problems,
)
from rlcore.config.cluster import (
    ClusterConfig,
    ModelConfig,
    engine_and_cluster_problems,
    model_problems,
    parallel_problems,
)
from rlcore.config.data import DataConfig, EvalConfig, eval_problems
from rlcore.config.distill import OPDConfig, opd_problems
from rlcore.config.fields import option, problem, problems_under, root_problems
from rlcore.config.optim import (
    OptimizerConfig,
    TrainConfig,
    batch_problems,
    optimizer_problems,
    schedule_problems,
    train_size_problems,
)
from rlcore.config.rollout import (
    MultiTurnConfig,
    RolloutConfig,
    multiturn_problems,
    rollout_problems,
)
from rlcore.errors import ConfigError, ConfigProblem

__all__ = ["RunConfig", "check", "float_fields"]


@attrs.frozen
class RunConfig:
    """Everything a run needs. Constructing one checks every cross-field invariant (see
    :func:`check`)."""

    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    debug: DebugConfig = DebugConfig()
    multiturn: MultiTurnConfig = MultiTurnConfig()
    opd: OPDConfig = OPDConfig()
    seed: int = option(1234, "--seed", "random seed")
    output_dir: Path = option(
        Path("runs/latest"), "--output-dir", "run folder for metrics and logs"
    )
    use_tensorboard: bool = option(False, "--use-tensorboard", "also write TensorBoard events")
    use_wandb: bool = option(False, "--use-wandb", "also log to Weights & Biases (offline works)")
    ray_address: str | None = option(
        None, "--ray-address", "join a Ray cluster (default: start a local one)"
    )

    def __attrs_post_init__(self) -> None:
        problems = check(self)
        if problems:
            raise ConfigError(problems)

    @property
    def is_eval_only(self) -> bool:
        return self.rollout.num_rollout == 0

    @property
    def corrects_off_policy(self) -> bool:
        """Whether the loss reweights tokens by the trainer/engine ratio: ``--use-tis``, or an
        off-policy schedule (``--max-staleness`` > 0), which implies it."""
        return self.algorithm.use_tis or self.rollout.max_staleness > 0

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout: one per global batch (none while the checks still see a
        global batch below 1)."""
        if self.train.global_batch_size < 1:
            return 0
        return self.samples_per_rollout // self.train.global_batch_size

    @property
    def total_train_steps(self) -> int:
        return (self.rollout.num_rollout or 0) * self.steps_per_rollout

    @property
    def lr_decay_steps(self) -> int:
        """``--lr-decay-iters`` or, by default, every optimizer step of the run."""
        if self.optim.lr_decay_iters is not None:
            return self.optim.lr_decay_iters
        return self.total_train_steps


@functools.cache
def float_fields() -> tuple[tuple[str, type[Any], str], ...]:
    """``(section, section class, field name)`` of every ``float`` (or ``float | None``) field;
    section ``""`` is :class:`RunConfig` itself."""
    out: list[tuple[str, type[Any], str]] = []
    sections = typing.get_type_hints(RunConfig)
    owners: list[tuple[str, type[Any]]] = [("", RunConfig)]
    owners += [(name, hint) for name, hint in sections.items() if attrs.has(hint)]
    for prefix, owner in owners:
        for name, hint in typing.get_type_hints(owner).items():
            if hint is float or hint == float | None:
                out.append((prefix, owner, name))
    return tuple(out)


def _non_finite(config: RunConfig) -> list[ConfigProblem]:
    problems = []
    for prefix, owner, name in float_fields():
        value = getattr(getattr(config, prefix) if prefix else config, name)
        if value is not None and not math.isfinite(value):
            problems.append(problem(owner, prefix, name, f"must be a finite number, got {value}"))
    return problems


def check(config: RunConfig) -> list[ConfigProblem]:
    """Every problem with ``config``, section by section; empty when it can run.

    A NaN or infinite number is reported alone (with every other one): the invariants that
    compare numbers would otherwise blame a neighbouring field (``lr = nan`` fails ``min_lr <=
    lr``). A problem derived from a field that is reported wrong itself is left out
    (:func:`~rlcore.config.fields.root_problems`)."""
    problems: list[ConfigProblem] = _non_finite(config)
    if problems:
        return problems
    r, m = config.rollout, config.model
    problems += engine_and_cluster_problems(r, config.cluster)
    problems += multiturn_problems(config.multiturn)
    problems += rollout_problems(r)
    problems += train_size_problems(config.train)
    problems += model_problems(m)
    problems += eval_problems(config.eval)
    problems += opd_problems(config.opd, config.algorithm)
    problems += checkpoint_problems(config.checkpoint, r.num_rollout)
    if not problems_under(problems, "cluster."):
        problems += parallel_problems(m, ranks_by_role(config))
    problems += debug_problems(
        config.debug,
        config.eval.interval,
        config.is_eval_only,
        r.max_staleness,
        config.checkpoint.max_restarts,
    )
    if r.num_rollout is None and r.num_epoch is None:
        problems.append(
            problem(
                RolloutConfig,
                "rollout",
                "num_rollout",
                "neither --num-rollout nor --num-epoch is given",
                "set --num-rollout N (0 evaluates only)",
            )
        )
    elif r.num_rollout == 0:
        if not config.eval.prompt_data:
            problems.append(
                problem(
                    RolloutConfig,
                    "rollout",
                    "num_rollout",
                    "0 means evaluate only, but there is nothing to evaluate",
                    "add --eval-prompt-data NAME PATH, or train with --num-rollout N > 0",
                    reads=("eval.prompt_data",),
                )
            )
    else:
        problems += training_problems(config)
    return root_problems(problems)


def training_problems(config: RunConfig) -> list[ConfigProblem]:
    """Invariants that only matter when the run trains: the algorithm's, the optimizer's, the
    batch split's and, when those hold, the LR schedule's length."""
    r = config.rollout
    problems = algorithm_problems(config.algorithm, r)
    problems += optimizer_problems(config.optim)
    m = config.model
    problems += batch_problems(
        config.train,
        r,
        m.tensor_model_parallel_size,
        ranks_by_role(config),
        m.pipeline_model_parallel_size,
    )
    if r.num_rollout is not None and r.num_rollout > 0 and not problems:
        reads = () if config.optim.lr_decay_iters is not None else _STEP_COUNT
        problems += schedule_problems(config.optim, config.lr_decay_steps, reads)
    return problems


_STEP_COUNT = (
    "rollout.num_rollout",
    "rollout.rollout_batch_size",
    "rollout.n_samples_per_prompt",
    "train.global_batch_size",
)
"""What the run's optimizer step count (the default LR decay length) is computed from."""


def ranks_by_role(config: RunConfig) -> dict[str, int]:
    """The rank count of each trained (or scored) model with its own ranks: the actor, and the
    critic when there is one (the reference model is split like the actor)."""
    ranks = {"actor": config.cluster.actor_ranks}
    if config.algorithm.critic:
        ranks["critic"] = config.cluster.critic_ranks
    return ranks
