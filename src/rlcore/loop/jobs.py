"""The three kinds of job a plan can be, and :func:`run`, which matches on the plan.

- A :class:`~rlcore.loop.plan.TrainPlan` runs a training schedule: the synchronous one
  (:func:`rlcore.loop.training.run_training`), or with ``--max-staleness`` the off-policy one
  that generates ahead of training (:func:`rlcore.loop.overlap.run_overlapped_training`).
- An :class:`~rlcore.loop.plan.EvalPlan` builds the actor's *eval* stack only, loads it, pushes its
  weights and evaluates every eval set (:func:`run_eval_only`).
- A :class:`~rlcore.loop.plan.RolloutOnlyPlan` (``--debug-rollout-only``) runs the rollout seam
  and nothing else (:func:`run_rollout_only`).

What can be checked before any stack is built is (:func:`check_inputs`,
:func:`~rlcore.loop.checkpoints.resume_point`). Ctrl-C raises
:class:`~rlcore.loop.records.RunInterrupted`, which carries what the run had done.
"""

from __future__ import annotations

import logging
import time
from typing import assert_never

from rlcore.checkpoint_files import find_checkpoint, read_meta, rollout_number
from rlcore.data.sampler import PromptSampler
from rlcore.errors import PlanError
from rlcore.loop.checkpoints import read_carried, resume_point
from rlcore.loop.contracts import CheckedEngine, build_eval_stack
from rlcore.loop.overlap import run_overlapped_training
from rlcore.loop.plan import EvalPlan, Plan, RolloutOnlyPlan, TrainPlan
from rlcore.loop.records import NullSink, Progress, RunData, RunInterrupted, RunResult
from rlcore.loop.rollouts import rollout_source
from rlcore.loop.stages import evaluate, push_weights, rollout_metrics, training_samples
from rlcore.loop.training import run_training
from rlcore.protocols.engine import RolloutEngine, TeacherServer
from rlcore.protocols.metrics import MetricsSink
from rlcore.protocols.rollout import Group, RewardFn, RolloutFn
from rlcore.protocols.stacks import Backend

__all__ = ["check_inputs", "run", "run_eval_only", "run_rollout_only"]

log = logging.getLogger("rlcore")


def check_inputs(plan: Plan, data: RunData) -> None:
    """Refuse, before anything is built, a run that would silently do nothing it was asked to:
    evaluating without eval sets, training without prompts, or (eval-only) evaluating weights
    that come from neither a checkpoint nor a model folder. Raises :class:`PlanError`."""
    evaluates = isinstance(plan, EvalPlan) or (
        isinstance(plan, TrainPlan) and (plan.eval_before_train or plan.eval_interval is not None)
    )
    if evaluates and not data.eval_sets:
        raise PlanError(
            "the plan evaluates (the config names eval sets: --eval-prompt-data) but the RunData "
            "holds no eval sets, so nothing would be evaluated; load them "
            "(rlcore.data.load_eval_sets) into RunData(eval_sets=...)"
        )
    if isinstance(plan, TrainPlan | RolloutOnlyPlan) and not data.train_prompts:
        raise PlanError(
            f"a {type(plan).__name__} needs prompts, but the RunData holds no train_prompts; "
            "load them (rlcore.data.load_prompts) into RunData(train_prompts=...)"
        )
    if (
        isinstance(plan, EvalPlan)
        and plan.load is None
        and plan.actor.model.hf_checkpoint is None
        and not plan.random_weights
    ):
        raise PlanError(
            "an eval-only run with neither a checkpoint (--load) nor a model folder "
            "(--hf-checkpoint) would evaluate the backend's freshly initialised, random weights; "
            "give one of them, or opt in with attrs.evolve(plan, random_weights=True)"
        )


def run_eval_only(
    plan: EvalPlan,
    backend: Backend,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    data: RunData,
    sink: MetricsSink,
    progress: Progress,
) -> RunResult:
    for line in plan.skipped:
        log.info("eval-only run, not built: %s", line)
    actor = build_eval_stack(backend, plan.actor)
    progress.built = ("eval:actor",)
    after = -1  # the rollout id the weights were trained through: none, for a model folder
    if plan.load is not None:
        folder = find_checkpoint(plan.load)
        after = actor.load(folder / "actor")
    push_weights(actor, engine, version=rollout_number(after))
    metrics = evaluate(
        engine, reward_fn, data.eval_sets, plan.eval_params, plan.n_samples_per_eval_prompt
    )
    # At the step a training run logs its evaluation of the same weights.
    sink.log(rollout_number(after), metrics)
    return RunResult((), (), (after,), metrics, {}, ("eval:actor",))


def run_rollout_only(
    plan: RolloutOnlyPlan,
    backend: Backend,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    data: RunData,
    sink: MetricsSink,
    progress: Progress,
    rollout_fn: RolloutFn | None = None,
) -> RunResult:
    """Generate (and save) every rollout; no training stack exists anywhere in this function."""
    for line in plan.skipped:
        log.info("rollout-only run, not built: %s", line)
    rollout = rollout_source(plan, engine, reward_fn, rollout_fn)
    start = plan.start_rollout_id or 0
    consumed = start * plan.rollout_batch_size
    carried: tuple[Group, ...] = ()
    if plan.load is not None:  # the checkpoint's weights, prompt position and carried groups
        folder = find_checkpoint(plan.load)
        meta = read_meta(folder)
        if not plan.finetune:
            start = meta.rollout_id + 1 if plan.start_rollout_id is None else plan.start_rollout_id
            consumed, carried = meta.consumed_prompts, read_carried(folder, meta.rollout_id)
        if start >= plan.num_rollout:
            raise PlanError(
                f"--load {plan.load}: the checkpoint {folder.name} is of rollout "
                f"{rollout_number(meta.rollout_id)}, so generation would start at rollout "
                f"{start + 1}, but --num-rollout is {plan.num_rollout}: nothing is left to "
                f"generate. Raise --num-rollout above {start}, or add --finetune to start at "
                "rollout 1 with the checkpoint's weights"
            )
        actor = build_eval_stack(backend, plan.actor)
        progress.built = ("eval:actor",)
        actor.load(folder / "actor")
        push_weights(actor, engine, version=start)
    sampler = PromptSampler(
        data.train_prompts, plan.rollout_batch_size, seed=data.seed, consumed=consumed
    )
    metrics: dict[str, float] = {}
    for rollout_id in range(start, plan.num_rollout):
        progress.current = rollout_id
        t0 = time.perf_counter()
        output = rollout(rollout_id, sampler, carried)  # the rollout seam, and nothing else
        carried = output.surplus
        samples = training_samples(output.groups)
        metrics = {
            **rollout_metrics(samples, policy_version=engine.weight_version),
            **output.metrics,
            "perf/generate_s": time.perf_counter() - t0,
        }
        progress.rollouts.append(rollout_id)
        sink.log(rollout_number(rollout_id), metrics)
    return RunResult((), (), (), {}, metrics, progress.built, tuple(progress.rollouts))


def run(
    plan: Plan,
    backend: Backend,
    engine: RolloutEngine | None,
    reward_fn: RewardFn,
    data: RunData,
    sink: MetricsSink | None = None,
    *,
    rollout_fn: RolloutFn | None = None,
    progress: Progress | None = None,
    teacher: TeacherServer | None = None,
) -> RunResult:
    """Run a planned job to the end. The match on the plan is exhaustive (checked by mypy).

    ``engine`` may be ``None`` only for a training plan that replays saved rollouts
    (``--load-debug-rollout-data``) and evaluates nothing; otherwise :class:`PlanError`.
    ``rollout_fn`` replaces the plan's rollout function (``--rollout-function-path``, else
    :func:`~rlcore.rollout.default_rollout`). ``teacher``: the server that scores the rollouts
    of a plan that distills from a served teacher (``--opd-type sglang``). ``progress``, when
    given, is kept up to date as the run goes, so that a caller can tell what a run that raised
    had done.

    Raises :class:`PlanError` before building anything when the inputs cannot do what the plan
    asks (:func:`check_inputs`, :func:`resume_point`), the rlcore error of a component that fails
    or breaks its contract, and :class:`RunInterrupted` on Ctrl-C.
    """
    sink = sink or NullSink()
    check_inputs(plan, data)
    checked = (
        engine if engine is None or isinstance(engine, CheckedEngine) else CheckedEngine(engine)
    )
    progress = progress if progress is not None else Progress()
    try:
        match plan:
            case EvalPlan():
                engine = _needed(checked, "evaluates")
                return run_eval_only(plan, backend, engine, reward_fn, data, sink, progress)
            case TrainPlan():
                resume_point(plan)  # a bad --load fails here, before any stack is built
                schedule = run_overlapped_training if plan.max_staleness else run_training
                return schedule(
                    plan, backend, checked, reward_fn, data, sink, progress, rollout_fn, teacher
                )
            case RolloutOnlyPlan():
                engine = _needed(checked, "generates rollouts")
                return run_rollout_only(
                    plan, backend, engine, reward_fn, data, sink, progress, rollout_fn
                )
            case _:
                assert_never(plan)
    except RunInterrupted:
        raise
    except KeyboardInterrupt:
        raise RunInterrupted(progress.result()) from None


def _needed(engine: RolloutEngine | None, what: str) -> RolloutEngine:
    if engine is None:
        raise PlanError(f"this plan {what}, but no rollout engine was given; pass one")
    return engine
