"""The stages of a run, each a function that can be called (and tested) alone.

A training run is these stages, arranged by a schedule (:mod:`rlcore.loop.training`); the save
and resume stages are in :mod:`rlcore.loop.checkpoints`, the export in
:mod:`rlcore.loop.hf_export`::

    build      build_stacks      the planned stacks (actor, critic only when planned, reference
                                 only when KL needs it)
    resume     resume            load every training stack from --load; the first rollout id,
                                 the prompt position and the groups carried into it
    rollout    rollout_source    the rollout seam: generate (or replay) one rollout's groups
                                 (:mod:`rlcore.loop.rollouts`)
    train      train_on_rollout  advantages, then critic and actor optimizer steps
               warm_start        or, for a supervised warm-start rollout, one step on the labels
    save       save_checkpoint   atomically, on the interval and after the last rollout
    export     export_hf         the actor as a Hugging Face folder (--save-hf), likewise
    sync       push_weights      the actor's weights to the rollout engine, as a new version
    eval       evaluate          every eval set with the engine

The "should we save / eval at rollout k" decisions are small pure functions, property-tested.
Every call into the backend, its stacks and the engine goes through :mod:`rlcore.loop.contracts`,
so a component that breaks its contract is named in an rlcore error.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import attrs

from rlcore.checkpoint_files import rollout_number
from rlcore.errors import PlanError
from rlcore.loop.contracts import build_eval_stack, build_training_stack
from rlcore.loop.plan import TrainPlan
from rlcore.protocols.engine import RolloutEngine, keep_weight_source, receive_weights_midway
from rlcore.protocols.rollout import Group, RewardFn, RolloutOutput
from rlcore.protocols.stacks import Backend, EvalStack, HFExporter, ModelStack, TrainingStack
from rlcore.rollout.default import (
    generate_groups,
)
from rlcore.samples import (
    EvalSet,
    ForwardRows,
    Generation,
    Prompt,
    Sample,
    SamplingParams,
    TrainBatch,
)
from rlcore.specs import EvalSpec, OPDSpec
from rlcore.weights import WeightSource

__all__ = [
    "TrainStacks",
    "build_stacks",
    "build_teacher",
    "evaluate",
    "make_train_batch",
    "push_weights",
    "rollout_metrics",
    "should_eval",
    "should_save",
    "train_on_rollout",
    "training_samples",
    "warm_start",
]

log = logging.getLogger("rlcore")


# --------------------------------------------------------------------------------------------
# Pure decisions


def should_save(rollout_id: int, num_rollout: int, save_interval: int | None, saving: bool) -> bool:
    """Save after rollout ``rollout_id``: on every ``save_interval``-th rollout, and always after
    the last one, when a save folder is set."""
    if not saving:
        return False
    last = rollout_id == num_rollout - 1
    return last or (save_interval is not None and (rollout_id + 1) % save_interval == 0)


def should_eval(rollout_id: int, num_rollout: int, eval_interval: int | None) -> bool:
    """Evaluate after rollout ``rollout_id``: on every ``eval_interval``-th rollout and after the
    last one, when an interval is set."""
    if eval_interval is None:
        return False
    return (rollout_id + 1) % eval_interval == 0 or rollout_id == num_rollout - 1


# --------------------------------------------------------------------------------------------
# Build and resume


@attrs.frozen
class TrainStacks:
    """The stacks a training run holds: critic and reference exist exactly when planned."""

    actor: TrainingStack
    critic: TrainingStack | None
    reference: EvalStack | None
    hf_exporter: HFExporter | None = None
    """The actor's Hugging Face export, when the plan asks for one (``--save-hf``)."""
    teacher: EvalStack | None = None
    """The on-policy distillation teacher (``--use-opd``, ``--opd-type backend``): an eval
    stack, never trained. A served teacher (``--opd-type sglang``) is no stack of the run."""

    def built(self) -> tuple[str, ...]:
        roles = [f"train:{name}" for name in self.training()]
        if self.reference is not None:
            roles.append("eval:reference")
        if self.teacher is not None:
            roles.append("eval:teacher")
        return tuple(roles)

    def training(self) -> dict[str, TrainingStack]:
        stacks = {"actor": self.actor}
        if self.critic is not None:
            stacks["critic"] = self.critic
        return stacks


def build_stacks(plan: TrainPlan, backend: Backend) -> TrainStacks:
    """The plan's stacks; a plan that exports to Hugging Face (``--save-hf``) is refused here,
    before anything trains, when the actor's stack cannot."""
    actor = build_training_stack(backend, plan.actor)
    exporter = actor.hf_exporter() if plan.save_hf is not None else None
    return TrainStacks(
        actor=actor,
        critic=build_training_stack(backend, plan.critic) if plan.critic is not None else None,
        reference=build_eval_stack(backend, plan.reference) if plan.reference is not None else None,
        hf_exporter=exporter,
        teacher=build_teacher(plan.opd, backend) if plan.opd is not None else None,
    )


def build_teacher(opd: OPDSpec, backend: Backend) -> EvalStack | None:
    """The distillation teacher: an eval stack of the spec's model folder, whose weights are then
    replaced by those of the checkpoint's actor when the spec names one (``--opd-teacher-load``;
    an eval stack's ``load`` restores weights only, never optimizer state). None for a served
    teacher, which the run does not build."""
    if not isinstance(opd.teacher, EvalSpec):
        return None
    teacher = build_eval_stack(backend, opd.teacher)
    if opd.teacher_load is not None:
        rollout_id = teacher.load(opd.teacher_load / "actor")
        log.info(
            "teacher: the actor of %s (rollout %d)", opd.teacher_load, rollout_number(rollout_id)
        )
    return teacher


# --------------------------------------------------------------------------------------------
# Train, save, sync, eval


def push_weights(
    source: WeightSource,
    engine: RolloutEngine,
    version: int,
    *,
    keeps: bool = True,
    midway: bool = False,
) -> None:
    """The policy's weights to the engine, straight from where they live (the engine's sinks go
    to the weights, not the weights to the caller), served from now on as ``version``.

    ``keeps``: whether ``source`` keeps these weights while the engine serves them (the
    synchronous schedule); then a server the engine restarts (``--use-fault-tolerance``) gets them
    from it again. Off-policy schedules train ahead and pass ``False``. ``midway``: the new
    weights interrupt in-flight generation at a token boundary instead of waiting for it
    (``--partial-rollout``; :func:`~rlcore.protocols.engine.receive_weights_midway`)."""
    receiving = (
        receive_weights_midway(engine, version) if midway else engine.receive_weights(version)
    )
    with receiving as sinks:
        source.send_weights(sinks)
    keep_weight_source(engine, source if keeps else None)


def evaluate(
    engine: RolloutEngine,
    reward_fn: RewardFn,
    eval_sets: Sequence[EvalSet],
    params: SamplingParams,
    n_samples: int,
) -> dict[str, float]:
    """Mean reward, pass@n (a prompt passes when any of its ``n`` samples scores >= 1) and mean
    response length per eval set, as ``eval/NAME/...``."""
    metrics: dict[str, float] = {}
    for eval_set in eval_sets:
        groups = generate_groups(engine, reward_fn, eval_set.prompts, n_samples, params)
        rewards = [s.reward for g in groups for s in g]
        prefix = f"eval/{eval_set.name}"
        metrics[f"{prefix}/reward"] = _mean(rewards)
        metrics[f"{prefix}/pass@{n_samples}"] = _mean(
            [float(max(s.reward for s in g) >= 1.0) for g in groups]
        )
        metrics[f"{prefix}/response_len"] = _mean(
            [float(len(s.response.token_ids)) for g in groups for s in g]
        )
    return metrics


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def make_train_batch(
    samples: Sequence[Sample], stacks: TrainStacks, plan: TrainPlan, rollout_id: int
) -> tuple[TrainBatch, dict[str, float]]:
    """Score the samples with the planned stacks and turn rewards into advantages.

    The actor's own log-probs are recomputed only when needed: for several optimizer steps per
    rollout (the ratio is no longer 1), for a KL reward penalty, or for on-policy distillation (the
    student's log-probs against the teacher's, :mod:`rlcore.algorithms.distill`, whose term
    :func:`~rlcore.algorithms.advantages.estimate_advantages` adds before it whitens).
    With ``--use-rollout-logprobs`` the engine's log-probs are the old ones instead (no recompute
    for the ratio). The reference model runs only when KL is planned, the teacher only with OPD,
    the critic only when it exists. The engine's log-probs always go into the batch
    (``rollout_log_probs``), for the mismatch metric and its correction.

    Each pass's real tokens per second is ``perf/NAME_tokens_per_sec`` (``actor_logprobs``,
    ``ref_logprobs``, ``critic_values``, ``teacher_logprobs``) and, when its stack says the
    positions it ran (:class:`~rlcore.samples.ForwardRows`), its padding fraction
    ``perf/NAME_padding``; ``perf/forward_padding`` is that of those passes together.
    """
    from rlcore.algorithms.advantages import estimate_advantages  # torch, only when training
    from rlcore.algorithms.distill import distillation_advantages

    engine_log_probs = tuple(s.response.log_probs for s in samples)
    use_engine = plan.actor.loss.use_rollout_logprobs
    needs_old = (
        (plan.actor.steps_per_rollout > 1 and not use_engine)
        or plan.advantage.kl_coef != 0
        or plan.opd is not None
    )
    metrics: dict[str, float] = {}
    tokens = sum(len(s.prompt.token_ids) + len(s.response.token_ids) for s in samples)
    ran = [0, 0]  # every pass's tokens and positions, of those that say them

    def scored(stack: ModelStack, name: str) -> tuple[tuple[float, ...], ...]:
        """``stack``'s pass over the samples, its throughput in ``perf/NAME_tokens_per_sec`` and,
        when it says the positions it ran, its padding fraction in ``perf/NAME_padding``."""
        t0 = time.perf_counter()
        rows = stack.forward(samples)
        metrics[f"perf/{name}_tokens_per_sec"] = tokens / max(time.perf_counter() - t0, 1e-9)
        if isinstance(rows, ForwardRows) and rows.padded_tokens > 0:
            metrics[f"perf/{name}_padding"] = _padding(rows.sequence_tokens, rows.padded_tokens)
            ran[0] += rows.sequence_tokens
            ran[1] += rows.padded_tokens
        return tuple(rows)

    old_log_probs = scored(stacks.actor, "actor_logprobs") if needs_old else ()
    reference = stacks.reference
    ref_log_probs = scored(reference, "ref_logprobs") if reference is not None else ()
    values = scored(stacks.critic, "critic_values") if stacks.critic is not None else ()
    distilled: tuple[tuple[float, ...], ...] = ()
    if plan.opd is not None:
        if stacks.teacher is not None:
            t0 = time.perf_counter()
            teacher_log_probs: Sequence[tuple[float, ...]] = scored(
                stacks.teacher, "teacher_logprobs"
            )
            metrics["perf/teacher_s"] = time.perf_counter() - t0
        else:  # served: the teacher scored each sample as its rollout was made
            teacher_log_probs = _served_scores(samples)
        masks = tuple(s.response.loss_mask for s in samples)
        opd = distillation_advantages(old_log_probs, teacher_log_probs, plan.opd.kl_coef, masks)
        distilled = opd.advantages
        metrics["opd/kl_mean"] = opd.kl_mean
        metrics["opd/teacher_logprob_mean"] = opd.teacher_logprob_mean
    if ran[1] > 0:  # all of the rollout's forward-only passes together, for the console
        metrics["perf/forward_padding"] = _padding(ran[0], ran[1])
    advantages: tuple[tuple[float, ...], ...] = distilled
    returns: tuple[tuple[float, ...], ...] = ()
    if plan.opd is None or not plan.opd.only:  # --opd-only: the teacher's term is the advantage
        adv = estimate_advantages(
            samples,
            plan.advantage,
            values=values,
            log_probs=old_log_probs,
            ref_log_probs=ref_log_probs,
            token_terms=distilled,
        )
        advantages, returns = adv.advantages, adv.returns
        metrics["rollout/kl_penalty"] = adv.kl
    if use_engine:
        ratio_old = engine_log_probs
    else:
        ratio_old = old_log_probs if plan.actor.steps_per_rollout > 1 else ()
    batch = TrainBatch(
        samples=tuple(samples),
        advantages=advantages,
        returns=returns if stacks.critic is not None else (),
        old_log_probs=ratio_old,
        ref_log_probs=ref_log_probs if plan.actor.loss.use_kl_loss else (),
        old_values=values,
        rollout_id=rollout_id,
        rollout_log_probs=engine_log_probs,
    )
    return batch, metrics


def _served_scores(samples: Sequence[Sample]) -> list[tuple[float, ...]]:
    unscored = [
        i for i, s in enumerate(samples) if len(s.teacher_log_probs) != len(s.response.token_ids)
    ]
    if unscored:
        raise PlanError(
            f"samples {unscored[:5]} carry no log-probs of the served teacher; the rollouts of a "
            "run that distills from a teacher server are scored by it in rollout_source "
            "(teacher=...)"
        )
    return [s.teacher_log_probs for s in samples]


def train(stacks: TrainStacks, batch: TrainBatch) -> dict[str, float]:
    """Critic first (it learns from this rollout's returns), then the actor. With each one's
    training metrics, ``perf/ROLE_train_tokens_per_sec`` (prompt + response tokens over its
    ``train_step``'s seconds) and ``perf/ROLE_train_padding`` (the fraction of the positions it
    ran that were padding) when its backend reports the token counts."""
    metrics: dict[str, float] = {}
    roles = [("critic", stacks.critic), ("actor", stacks.actor)]
    for role, stack in roles:
        if stack is None:
            continue
        t0 = time.perf_counter()
        result = stack.train_step(batch)
        seconds = time.perf_counter() - t0
        metrics.update(result.as_dict(f"train/{role}"))
        if result.padded_tokens > 0:
            metrics[f"perf/{role}_train_tokens_per_sec"] = result.sequence_tokens / seconds
            metrics[f"perf/{role}_train_padding"] = _padding(
                result.sequence_tokens, result.padded_tokens
            )
    return metrics


def _padding(tokens: int, positions: int) -> float:
    """The fraction of the ``positions`` a pass ran that were padding (it ran ``tokens`` real
    ones)."""
    return 1 - tokens / positions


def train_on_rollout(
    plan: TrainPlan, stacks: TrainStacks, rollout_id: int, output: RolloutOutput
) -> dict[str, float]:
    """The train stage of one generated rollout: advantages (scoring the samples with the planned
    stacks), then the optimizer steps. Returns the rollout's metrics (its samples', the rollout
    function's, the KL penalty, the stacks' training metrics) and ``perf/advantages_s`` and
    ``perf/train_s``."""
    t0 = time.perf_counter()
    samples = training_samples(output.groups)
    batch, adv_metrics = make_train_batch(samples, stacks, plan, rollout_id)
    t1 = time.perf_counter()
    metrics = {
        **rollout_metrics(samples, policy_version=rollout_id),
        **output.metrics,
        **adv_metrics,
        **train(stacks, batch),
    }
    metrics["perf/advantages_s"] = t1 - t0
    metrics["perf/train_s"] = time.perf_counter() - t1
    return metrics


def warm_start(
    prompts: Sequence[Prompt], actor: TrainingStack, plan: TrainPlan, rollout_id: int
) -> dict[str, float]:
    """One warm-start rollout: the actor trains on each prompt's reference completion, repeated
    ``n_samples_per_prompt`` times so batch sizes match the RL rollouts. With advantage 1 and
    ratio 1 the policy loss's gradient is exactly the SFT (token-mean NLL) gradient."""
    missing = [p.index for p in prompts if not p.target_token_ids]
    if missing:
        raise PlanError(
            f"--sft-warmup-rollouts needs labelled prompts, but prompts {missing[:5]} have no "
            "reference completion; give the data a label key (--label-key) or drop the warm start"
        )
    samples = tuple(
        Sample(
            prompt=p,
            response=Generation(
                p.target_token_ids, tuple(0.0 for _ in p.target_token_ids), p.label, "stop"
            ),
            reward=1.0,
            group=i,
        )
        for i, p in enumerate(prompts)
        for _ in range(plan.n_samples_per_prompt)
    )
    batch = TrainBatch(
        samples,
        advantages=tuple(tuple(1.0 for _ in s.response.token_ids) for s in samples),
        rollout_id=rollout_id,
    )
    # No rollout_log_probs: the labels were not sampled by an engine, nothing to correct.
    metrics = actor.train_step(batch).as_dict("train/actor")
    return {**metrics, "rollout/supervised": 1.0}


def rollout_metrics(samples: Sequence[Sample], policy_version: int) -> dict[str, float]:
    """Reward, response length, truncation, the sampled tokens' entropy estimate, and how many
    weight versions the samples' generations lag behind ``policy_version`` (0 on-policy; 1 for
    groups carried from the previous rollout). With multi-turn episodes also model turns per
    episode (``rollout/turns``) and the share of response tokens the model generated
    (``rollout/model_token_frac``)."""
    metrics = {
        "rollout/reward": _mean([s.reward for s in samples]),
        "rollout/response_len": _mean([float(len(s.response.token_ids)) for s in samples]),
        "rollout/truncated": _mean([float(s.response.finish_reason == "length") for s in samples]),
        "rollout/weight_version_lag": _mean(
            [float(policy_version - s.response.weight_version) for s in samples]
        ),
        # -E[log p] of the model's sampled tokens: an estimate of the tempered distribution's
        # entropy (unbiased without top-k / top-p), cheap, and always there, unlike the loss's.
        "rollout/entropy": _mean(
            [
                -lp
                for s in samples
                for lp, m in zip(s.response.log_probs, s.response.model_mask, strict=True)
                if m
            ]
        ),
    }
    if any(s.response.turns for s in samples):
        turns = [
            sum(t.role == "model" for t in s.response.turns) if s.response.turns else 1
            for s in samples
        ]
        metrics["rollout/turns"] = _mean([float(n) for n in turns])
        total = sum(len(s.response.token_ids) for s in samples)
        model = sum(s.response.model_tokens for s in samples)
        metrics["rollout/model_token_frac"] = model / total if total else 0.0
    return metrics


def training_samples(groups: Sequence[Group]) -> tuple[Sample, ...]:
    """The groups' samples in order, each sample's ``group`` set to its group's position (what
    the grouped advantage estimators read), whatever the rollout function numbered."""
    return tuple(
        s if s.group == i else attrs.evolve(s, group=i) for i, g in enumerate(groups) for s in g
    )
