"""The planner: an EvalPlan exactly for num_rollout 0; training plans satisfy Megatron's asserts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rlcore.config import RunConfig, structure_config
from rlcore.config.flags import load_config
from rlcore.errors import ConfigError, PlanError
from rlcore.loop.plan import EvalPlan, TrainPlan, plan, resolve_num_rollout
from rlcore.specs import (
    LossSpec,
    LRSchedule,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    TrainSpec,
)
from tests.strategies import config_dicts, valid_config_dicts


def _config(data: dict[str, Any]) -> RunConfig:
    try:
        return structure_config(data)
    except ConfigError:
        assume(False)
        raise


@given(st.one_of(valid_config_dicts(), config_dicts()))
def test_plan_kind_and_contents_follow_the_config(data: dict[str, Any]) -> None:
    config = _config(data)
    result = plan(config)
    precision = "bfloat16" if config.model.bf16 else "float32"
    if config.rollout.num_rollout == 0:
        assert isinstance(result, EvalPlan)
        assert result.actor.model.precision == precision
        assert not hasattr(result, "critic") and not hasattr(result, "reference")
        assert not hasattr(result, "schedule") and not hasattr(result.actor, "optimizer")
        return
    assert isinstance(result, TrainPlan)
    schedule = result.actor.optimizer.schedule
    assert (
        schedule.decay_steps > 0 and 0 <= schedule.warmup_steps < schedule.decay_steps
    )  # Megatron's asserts
    assert (result.critic is not None) == config.algorithm.critic
    assert (result.reference is not None) == config.algorithm.uses_kl
    # One precision for every model of the run, and every policy scores at the rollout's
    # sampling temperature; the optimizer kind follows its flag.
    for spec in (result.actor, result.critic, result.reference):
        assert spec is None or spec.model.precision == precision
        assert spec is None or spec.model.temperature == config.rollout.temperature
    # Evaluation samples at its own temperature, which no training log-prob reads.
    assert result.eval_params.temperature == config.eval.temperature
    for train in (result.actor, result.critic):
        assert (
            train is None or train.optimizer.distributed == config.optim.use_distributed_optimizer
        )
    if result.critic is not None:
        assert result.critic.model.role == "critic"
    assert (
        result.actor.steps_per_rollout * result.actor.global_batch_size
        == config.samples_per_rollout
    )
    advantage, algorithm = result.advantage, config.algorithm
    assert advantage.estimator == algorithm.advantage_estimator
    assert advantage.group_size == config.rollout.n_samples_per_prompt
    assert (advantage.normalize_std, advantage.whiten) == (
        algorithm.normalize_std,
        algorithm.normalize_advantages,
    )


def test_eval_plan_says_what_it_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("x.jsonl").touch()
    config = load_config(
        [
            "--num-rollout",
            "0",
            "--eval-prompt-data",
            "x",
            "x.jsonl",
            "--use-critic",
            "--use-kl-loss",
        ]
    )
    result = plan(config)
    assert isinstance(result, EvalPlan)
    assert any("critic" in line for line in result.skipped)
    assert any("reference" in line for line in result.skipped)


def test_num_epoch_resolves_to_num_rollout() -> None:
    config = load_config(
        [
            "--num-epoch",
            "2",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "8",
            "--micro-batch-size",
            "8",
        ]
    )
    with pytest.raises(PlanError, match="resolve_num_rollout"):
        plan(config)
    resolved = resolve_num_rollout(config, num_prompts=10)
    assert resolved.rollout.num_rollout == 5
    assert isinstance(plan(resolved), TrainPlan)


@given(config_dicts(eval_data=True))
def test_lr_schedule_refuses_what_megatron_would_assert_on(data: dict[str, Any]) -> None:
    o = data["optim"]
    decay, warmup = o.get("lr_decay_iters", 1), o["lr_warmup_iters"]
    try:
        LRSchedule(lr=1e-5, min_lr=0.0, warmup_steps=warmup, decay_steps=decay)
    except ValueError:
        assert decay < 1 or not 0 <= warmup < decay
    else:
        assert decay >= 1 and 0 <= warmup < decay


def test_lr_schedule_decays_to_min_lr() -> None:
    s = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=2, decay_steps=10, decay_style="linear")
    assert s.lr_at(0) == 0.0 and s.lr_at(1) == 0.5 and s.lr_at(2) == 1.0
    assert s.lr_at(10) == pytest.approx(0.1) and s.lr_at(50) == 0.1
    assert attrs.evolve(s, decay_style="cosine").lr_at(6) == pytest.approx(0.55)


def _train_spec(global_batch: int, micro_batch: int, tp: int, world: int) -> TrainSpec:
    return TrainSpec(
        model=ModelSpec("actor", None, parallel=ParallelSpec(tp, world)),
        optimizer=OptimizerSpec(LRSchedule(lr=1e-5, min_lr=0.0, warmup_steps=0, decay_steps=1)),
        loss=LossSpec(),
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
    )


@given(
    st.integers(1, 12), st.integers(1, 4), st.sampled_from([(1, 1), (1, 2), (2, 2), (1, 3), (2, 4)])
)
def test_train_spec_splits_into_whole_micro_batches_by_construction(
    global_batch: int, micro_batch: int, parallel: tuple[int, int]
) -> None:
    tp, world = parallel
    dp = world // tp
    try:
        spec = _train_spec(global_batch, micro_batch, tp, world)
    except ValueError as exc:
        assert global_batch % (micro_batch * dp)
        assert f"micro_batch_size x data-parallel ranks = {micro_batch} x {dp}" in str(exc)
    else:
        per_rank = spec.global_batch_size // spec.model.parallel.data
        assert per_rank % spec.micro_batch_size == 0


def test_train_spec_refuses_sizes_below_one() -> None:
    with pytest.raises(ValueError, match="TrainSpec.micro_batch_size must be >= 1"):
        _train_spec(4, 0, 1, 1)
    with pytest.raises(ValueError, match="TrainSpec.global_batch_size must be >= 1"):
        _train_spec(0, 1, 1, 1)


@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 8),
    st.sampled_from([1, 2, 3]),
    st.sampled_from([1, 2, 3]),
)
def test_a_config_that_loads_plans_into_valid_train_specs(
    rollout_batch: int, n_samples: int, global_batch: int, micro_batch: int, gpus: int
) -> None:
    """The config check applies TrainSpec's own batch rule, with the field path and the flag."""
    argv = [
        *("--num-rollout", "2", "--rollout-batch-size", str(rollout_batch)),
        *("--n-samples-per-prompt", str(n_samples), "--advantage-estimator", "reinforce_plus_plus"),
        *("--global-batch-size", str(global_batch), "--micro-batch-size", str(micro_batch)),
        *("--actor-num-gpus-per-node", str(gpus)),
    ]
    try:
        config = load_config(argv)
    except ConfigError as exc:
        split = [p for p in exc.problems if "data-parallel ranks" in p.message]
        if global_batch % (micro_batch * gpus):
            assert [p.path for p in split] == ["train.micro_batch_size (--micro-batch-size)"]
        else:
            assert not split
        return
    result = plan(config)
    assert isinstance(result, TrainPlan)
    assert result.actor.global_batch_size % (micro_batch * gpus) == 0
