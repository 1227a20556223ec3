"""Hypothesis over plans the planner accepts: the Megatron backend builds exactly what is planned.

num_rollout (0 = eval only), use_critic, KL on/off, warmup/decay and the batch split are drawn by
``tests.strategies.valid_config_dicts``; the model is the tiny HF Llama. Building never raises, an
optimizer and a scheduler exist exactly on the training stacks, a critic exactly when planned, and
no Megatron assertion is reached while the scheduler walks the whole run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from rlcore.config import structure_config
from rlcore.loop.plan import EvalPlan, TrainPlan, plan
from rlcore.protocols.stacks import EvalStack, TrainingStack
from rlcore_megatron.backend import MegatronBackend
from tests.megatron.helpers import make_batch, make_samples
from tests.strategies import valid_config_dicts

pytestmark = pytest.mark.megatron


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=valid_config_dicts())
def test_planned_stacks_build_and_train(tiny_hf: Path, data: dict[str, Any]) -> None:
    data["model"] = {"hf_checkpoint": str(tiny_hf)}
    the_plan = plan(structure_config(data))
    backend = MegatronBackend()
    match the_plan:
        case EvalPlan():
            actor = backend.build_eval_stack(the_plan.actor)
            assert isinstance(actor, EvalStack)
            assert not hasattr(actor, "optimizer") and not hasattr(actor, "scheduler")
        case TrainPlan():
            trained = backend.build_training_stack(the_plan.actor)
            critic = backend.build_training_stack(the_plan.critic) if the_plan.critic else None
            reference = backend.build_eval_stack(the_plan.reference) if the_plan.reference else None
            algorithm = data["algorithm"]
            assert (critic is not None) == (
                algorithm["use_critic"] or algorithm["advantage_estimator"] == "ppo"
            )
            for stack in (trained, critic):
                if stack is not None:
                    assert isinstance(stack, TrainingStack)
                    assert stack.optimizer is not None and stack.scheduler is not None
            if reference is not None:
                assert not hasattr(reference, "optimizer")

            n = the_plan.rollout_batch_size * the_plan.n_samples_per_prompt
            samples = make_samples(n, seed=n)
            batch = make_batch(
                samples,
                returns=critic is not None,
                ref=the_plan.actor.loss.use_kl_loss,
            )
            metrics = trained.train_step(batch)  # reports the lr of its last optimizer step
            last = the_plan.actor.steps_per_rollout - 1
            assert metrics.lr == pytest.approx(the_plan.actor.optimizer.schedule.lr_at(last))
            if critic is not None:
                critic.train_step(batch)
            # the rest of the run's schedule, without the maths: no assertion on the way
            schedule = the_plan.actor.optimizer.schedule
            total = the_plan.num_rollout * the_plan.actor.steps_per_rollout
            for step in range(the_plan.actor.steps_per_rollout, total):
                assert trained.optimizer.param_groups[0]["lr"] == pytest.approx(
                    schedule.lr_at(step)
                )
                trained.scheduler.step(increment=1)
