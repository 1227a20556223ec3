"""The rollout stage: one rollout's groups from the rollout seam (a user's rollout function, or
:func:`~rlcore.rollout.default_rollout` with the plan's dynamic sampling), replayed from saved
rollouts, or scored by a served distillation teacher as they are made. A schedule calls the
:data:`RolloutSource` that :func:`rollout_source` makes from a plan."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import attrs

from rlcore.checkpoint_files import rollout_number
from rlcore.errors import PlanError, RLCoreError, RolloutError
from rlcore.loop.plan import RolloutOnlyPlan, TrainPlan
from rlcore.protocols.engine import RolloutEngine, TeacherServer
from rlcore.protocols.rollout import (
    DynamicSampling,
    Group,
    GroupFilter,
    PromptSource,
    RewardFn,
    RolloutContext,
    RolloutFn,
    RolloutOutput,
)
from rlcore.rollout.default import (
    check_reward_nonzero_std,
    check_rollout_output,
    default_rollout,
    load_group_filter,
    load_rollout_function,
)
from rlcore.rollout.replay import load_rollout_data, save_rollout_data
from rlcore.samples import Generation, Prompt
from rlcore.specs import ServedTeacher

__all__ = ["RolloutSource", "group_filter_of", "rollout_source", "score_by_teacher"]

log = logging.getLogger("rlcore")


RolloutSource = Callable[[int, PromptSource, tuple[Group, ...]], RolloutOutput]
"""One rollout as the loop calls it: ``(rollout_id, prompts, carried groups) -> output``."""


def rollout_source(
    plan: TrainPlan | RolloutOnlyPlan,
    engine: RolloutEngine | None,
    reward_fn: RewardFn,
    rollout_fn: RolloutFn | None = None,
    teacher: TeacherServer | None = None,
) -> RolloutSource:
    """The plan's rollouts: replayed from ``plan.replay_rollout_data`` (no engine), or produced by
    ``rollout_fn`` (default: ``plan.rollout.function_path``, else
    :func:`~rlcore.rollout.default_rollout`) with the engine; every output is checked against the
    batch size and, with ``plan.rollout.save_debug_data``, saved. With a served distillation
    teacher (``--opd-type sglang``) ``teacher`` then scores every sample of the output
    (:func:`score_by_teacher`).

    User functions (rollout function, group filter) are imported here, so a bad path fails before
    anything is built. Raises :class:`PlanError` when the plan generates and ``engine`` is None,
    or distills from a served teacher and ``teacher`` is None.
    """
    source = _rollouts(plan, engine, reward_fn, rollout_fn)
    opd = plan.opd if isinstance(plan, TrainPlan) else None
    if opd is None or not isinstance(opd.teacher, ServedTeacher):
        return source
    if teacher is None:
        raise PlanError(
            f"this plan distills from the teacher served at {opd.teacher.url} "
            "(--opd-type sglang), but no teacher server was given; pass one "
            "(rlcore_sglang.SGLangTeacher)"
        )
    served, temperature = teacher, plan.rollout_params.temperature
    log.info("teacher: the server at %s scores each rollout as it is made", opd.teacher.url)

    def scored(rollout_id: int, prompts: PromptSource, carried: tuple[Group, ...]) -> RolloutOutput:
        output = source(rollout_id, prompts, carried)
        t0 = time.perf_counter()
        groups = score_by_teacher(served, output.groups, temperature)
        metrics = {**output.metrics, "perf/teacher_s": time.perf_counter() - t0}
        return attrs.evolve(output, groups=groups, metrics=metrics)

    return scored


def score_by_teacher(
    teacher: TeacherServer, groups: Sequence[Group], temperature: float
) -> tuple[Group, ...]:
    """The groups, each sample carrying the served teacher's log-prob of each of its response
    tokens at the rollout's sampling ``temperature`` (``Sample.teacher_log_probs``). Raises
    :class:`RolloutError` when the teacher's answer does not have one log-prob per response
    token."""
    samples = [s for g in groups for s in g]
    scores = teacher.score(samples, temperature)
    name = type(teacher).__name__
    if len(scores) != len(samples):
        raise RolloutError(
            f"the teacher server {name} scored {len(scores)} samples of {len(samples)}"
        )
    for i, (sample, score) in enumerate(zip(samples, scores, strict=True)):
        if len(score) != len(sample.response.token_ids):
            raise RolloutError(
                f"the teacher server {name} gave sample {i} {len(score)} log-probs for "
                f"{len(sample.response.token_ids)} response tokens"
            )
    it = iter(scores)
    return tuple(
        tuple(attrs.evolve(s, teacher_log_probs=tuple(next(it))) for s in g) for g in groups
    )


def _rollouts(
    plan: TrainPlan | RolloutOnlyPlan,
    engine: RolloutEngine | None,
    reward_fn: RewardFn,
    rollout_fn: RolloutFn | None,
) -> RolloutSource:
    """:func:`rollout_source` before the teacher scores."""
    size, n = plan.rollout_batch_size, plan.n_samples_per_prompt
    if isinstance(plan, TrainPlan) and plan.replay_rollout_data is not None:
        template = plan.replay_rollout_data
        log.info("replaying the rollouts saved under %s: no rollout engine is used", template)

        def replay(
            rollout_id: int, prompts: PromptSource, carried: tuple[Group, ...]
        ) -> RolloutOutput:
            del prompts, carried
            groups = load_rollout_data(template, rollout_id)
            return check_rollout_output(RolloutOutput(groups), f"replay of {template}", size, n)

        return replay
    if engine is None:
        raise PlanError(
            "this plan generates rollouts, but no rollout engine was given; pass one, or replay "
            "saved rollouts (--load-debug-rollout-data)"
        )
    spec = plan.rollout
    if rollout_fn is not None:
        fn, name = rollout_fn, getattr(rollout_fn, "__qualname__", type(rollout_fn).__qualname__)
        fix = "fix the rollout function given to rlcore.run"
    elif spec.function_path is not None:
        fn, name = load_rollout_function(spec.function_path), spec.function_path
        fix = "fix the function --rollout-function-path names"
    else:
        fn, name = default_rollout, "rlcore.rollout:default_rollout"
        fix = "this is a bug in rlcore: please report it with the traceback in run.log"
    sampling = DynamicSampling(
        over_sampling_batch_size=spec.over_sampling_batch_size or size,
        max_rounds=spec.max_rounds,
        keep_surplus=spec.keep_surplus,
        group_filter=group_filter_of(plan),
    )
    generating_engine = engine
    if _reward_free(plan):
        reward_fn = _no_reward  # --opd-only: the teacher is the only signal; labels are not read

    def produce(
        rollout_id: int, prompts: PromptSource, carried: tuple[Group, ...]
    ) -> RolloutOutput:
        ctx = RolloutContext(
            rollout_id=rollout_id,
            prompts=prompts,
            engine=generating_engine,
            reward_fn=reward_fn,
            params=plan.rollout_params,
            n_samples_per_prompt=n,
            batch_size=size,
            sampling=sampling,
            carried=carried,
        )
        try:
            returned = fn(ctx)
        except RLCoreError:
            raise
        except Exception as exc:
            raise RolloutError(
                f"rollout function {name} raised {type(exc).__name__}: {exc} at rollout "
                f"{rollout_number(rollout_id)}; {fix}"
            ) from exc
        output = check_rollout_output(returned, name, size, n)
        if spec.save_debug_data is not None:
            save_rollout_data(spec.save_debug_data, rollout_id, output.groups)
        return output

    return produce


def group_filter_of(plan: TrainPlan | RolloutOnlyPlan) -> GroupFilter | None:
    """The plan's dynamic-sampling filter (``--dynamic-sampling-filter-path``), imported. Raises
    :class:`PlanError` for the built-in reward filter in a pure-distillation plan
    (``--opd-only``): no sample is scored there, so it would keep no group, and the run would
    fail only after ``--max-rounds`` rounds of generation."""
    path = plan.rollout.filter_path
    if path is None:
        return None
    group_filter = load_group_filter(path)
    if group_filter is check_reward_nonzero_std and _reward_free(plan):
        raise PlanError(
            f"--dynamic-sampling-filter-path {path} keeps the groups whose rewards differ, but "
            "with --opd-only no sample is scored (every reward is 0), so it would keep none; "
            "drop it (a distillation signal varies within a group without it)"
        )
    return group_filter


def _reward_free(plan: TrainPlan | RolloutOnlyPlan) -> bool:
    return isinstance(plan, TrainPlan) and plan.opd is not None and plan.opd.only


def _no_reward(prompt: Prompt, generation: Generation) -> float:
    """The reward of a pure-distillation sample (``--opd-only``): none, so nothing is scored."""
    del prompt, generation
    return 0.0
