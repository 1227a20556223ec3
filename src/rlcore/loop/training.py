"""The synchronous training schedule: the stages of :mod:`rlcore.loop.stages`, one after the other.

::

    build -> resume -> sync -> [eval]
    -> for each rollout id: rollout (or a warm-start batch) -> train -> save (interval, and
                            always after the last) -> sync -> eval (interval)
                            [-> save and stop, when asked to stop early]

Each stage waits for the one before: the engine is idle while the stacks train and the stacks
are idle while the engine generates. What a rollout trains on is generated with the weights of
the rollout before it (version ``rollout_id``), so every sample is on-policy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from rlcore.checkpoint_files import rollout_number
from rlcore.data.sampler import PromptSampler
from rlcore.errors import PlanError
from rlcore.loop.checkpoints import resume
from rlcore.loop.plan import TrainPlan
from rlcore.loop.records import Progress, RunData, RunResult
from rlcore.loop.rollouts import rollout_source
from rlcore.loop.stages import (
    build_stacks,
    push_weights,
    should_eval,
    train_on_rollout,
    warm_start,
)
from rlcore.loop.tail import Evaluation, save_and_export, wants_save
from rlcore.protocols.engine import RolloutEngine, TeacherServer
from rlcore.protocols.metrics import MetricsSink
from rlcore.protocols.rollout import RewardFn, RolloutFn
from rlcore.protocols.stacks import Backend

__all__ = ["run_training"]


def run_training(
    plan: TrainPlan,
    backend: Backend,
    engine: RolloutEngine | None,
    reward_fn: RewardFn,
    data: RunData,
    sink: MetricsSink,
    progress: Progress,
    rollout_fn: RolloutFn | None = None,
    teacher: TeacherServer | None = None,
) -> RunResult:
    """Train ``plan`` to its last rollout with the synchronous schedule (module docstring).

    ``engine`` is ``None`` only when the plan replays saved rollouts and evaluates nothing.
    What has been done is kept in ``progress`` as it happens, for Ctrl-C to report.
    """
    evaluates = bool(data.eval_sets) and (plan.eval_before_train or plan.eval_interval is not None)
    if engine is None and evaluates:
        raise PlanError("this plan evaluates, but no rollout engine was given to evaluate with")
    produce = rollout_source(plan, engine, reward_fn, rollout_fn, teacher)
    stacks = build_stacks(plan, backend)
    progress.built = stacks.built()
    resumed = resume(plan, stacks)
    start, carried, pending = resumed.first, resumed.carried, dict(resumed.pending)
    sampler = PromptSampler(
        data.train_prompts, plan.rollout_batch_size, seed=data.seed, consumed=resumed.consumed
    )
    if engine is not None:
        push_weights(stacks.actor, engine, version=start)

    def run_eval(after: int) -> Mapping[str, float]:
        assert engine is not None  # checked above: a plan that evaluates has an engine
        return Evaluation(plan, engine, reward_fn, data.eval_sets, sink, progress)(after)

    last_eval: Mapping[str, float] = run_eval(start - 1) if plan.eval_before_train else {}
    last_train: Mapping[str, float] = {}
    for rollout_id in range(start, plan.num_rollout):
        progress.current = rollout_id
        t0 = time.perf_counter()
        if rollout_id < plan.sft_warmup_rollouts:
            metrics = warm_start(sampler.next_batch(), stacks.actor, plan, rollout_id)
            metrics.update(
                {
                    "perf/generate_s": 0.0,
                    "perf/advantages_s": 0.0,
                    "perf/train_s": time.perf_counter() - t0,
                }
            )
        else:
            # The rollout seam (or a rollout an off-policy run generated ahead and saved).
            output = pending.pop(rollout_id, None) or produce(rollout_id, sampler, carried)
            carried = output.surplus
            progress.rollouts.append(rollout_id)
            generate_s = time.perf_counter() - t0
            metrics = train_on_rollout(plan, stacks, rollout_id, output)
            metrics["perf/generate_s"] = generate_s
        progress.trained.append(rollout_id)
        stopping = progress.stop.is_set()  # asked to stop early: save this rollout, then stop
        try:
            metrics["perf/save_s"] = save_and_export(
                plan,
                stacks,
                rollout_id,
                progress,
                saving=wants_save(plan, rollout_id, stopping),
                consumed=sampler.consumed,
                carried=carried,
                keep=resumed.loaded,
            )
            t2 = time.perf_counter()
            if engine is not None:
                push_weights(stacks.actor, engine, version=rollout_id + 1)
            metrics["perf/weight_sync_s"] = time.perf_counter() - t2
            metrics["rollout/weight_version"] = float(rollout_id + 1)
        finally:
            # A trained rollout's metrics are logged even when its save or weight sync is
            # interrupted (Ctrl-C) or fails: the optimizer step they describe happened.
            last_train = metrics
            sink.log(rollout_number(rollout_id), metrics)
        if should_eval(rollout_id, plan.num_rollout, plan.eval_interval):
            last_eval = run_eval(rollout_id)
        if stopping:
            break
    return progress.finished(plan.num_rollout, last_eval, last_train)
