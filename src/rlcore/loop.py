"""The RL loop, written only against the protocols. It reads in the order a run happens.

Training::

    build stacks -> resume (all stacks agree on the rollout id) -> push weights -> [eval]
    -> for each rollout id: generate -> reward -> advantages -> train (critic, then actor)
                            -> save (interval, and always after the last) -> push weights
                            -> eval (interval)

Eval-only: build the actor's *eval* stack, load, push weights, evaluate every eval set, return.

The "should we save / eval at rollout k" decisions are small pure functions, property-tested.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import assert_never

import attrs

from rlcore.checkpoints import CheckpointMeta, find_checkpoint, read_meta, write_checkpoint
from rlcore.data import PromptSampler
from rlcore.errors import CheckpointError, PlanError
from rlcore.plan import EvalPlan, Plan, TrainPlan
from rlcore.protocols import (
    Backend,
    EvalStack,
    MetricsSink,
    RewardFn,
    RolloutEngine,
    TrainingStack,
    WeightSource,
)
from rlcore.rewards import score_samples
from rlcore.samples import EvalSet, Generation, Prompt, Sample, SamplingParams, TrainBatch

__all__ = [
    "RunData",
    "RunResult",
    "TrainStacks",
    "evaluate",
    "push_weights",
    "run",
    "should_eval",
    "should_save",
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
# Inputs and outputs


@attrs.frozen
class RunData:
    """The prompts a run uses: training prompts (empty for eval-only) and eval sets."""

    train_prompts: tuple[Prompt, ...] = ()
    eval_sets: tuple[EvalSet, ...] = ()
    seed: int = 1234


@attrs.frozen
class RunResult:
    """What happened, for callers and tests: the rollout ids trained, saved and evaluated after
    (``-1`` stands for "before training"), and the last metrics of each kind."""

    trained: tuple[int, ...]
    saved: tuple[int, ...]
    evaluated: tuple[int, ...]
    last_eval: Mapping[str, float]
    last_train: Mapping[str, float]
    built: tuple[str, ...] = ()
    """The stacks built, as ``train:ROLE`` / ``eval:ROLE``."""


class _NullSink:
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        del step, metrics

    def close(self) -> None:
        pass


@attrs.frozen
class TrainStacks:
    """The stacks a training run holds: critic and reference exist exactly when planned."""

    actor: TrainingStack
    critic: TrainingStack | None
    reference: EvalStack | None

    def built(self) -> tuple[str, ...]:
        roles = [f"train:{name}" for name in self.training()]
        return (*roles, "eval:reference") if self.reference is not None else tuple(roles)

    def training(self) -> dict[str, TrainingStack]:
        stacks = {"actor": self.actor}
        if self.critic is not None:
            stacks["critic"] = self.critic
        return stacks


# --------------------------------------------------------------------------------------------
# Steps


def push_weights(source: WeightSource, engine: RolloutEngine, version: int) -> None:
    """The policy's weights to the engine, straight from where they live (the engine's sinks go
    to the weights, not the weights to the caller), served from now on as ``version``."""
    with engine.receive_weights(version) as sinks:
        source.send_weights(sinks)


def generate(
    engine: RolloutEngine, prompts: Sequence[Prompt], n: int, params: SamplingParams
) -> list[Generation]:
    """``n`` generations per prompt, each prompt's consecutive (a GRPO group)."""
    return engine.generate([p for p in prompts for _ in range(n)], params)


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
        generations = generate(engine, eval_set.prompts, n_samples, params)
        samples = score(eval_set.prompts, generations, reward_fn, n_samples)
        rewards = [s.reward for s in samples]
        groups = [rewards[i : i + n_samples] for i in range(0, len(rewards), n_samples)]
        prefix = f"eval/{eval_set.name}"
        metrics[f"{prefix}/reward"] = _mean(rewards)
        metrics[f"{prefix}/pass@{n_samples}"] = _mean([float(max(g) >= 1.0) for g in groups])
        metrics[f"{prefix}/response_len"] = _mean([float(len(g.token_ids)) for g in generations])
    return metrics


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else 0.0


def make_train_batch(
    samples: Sequence[Sample], stacks: TrainStacks, plan: TrainPlan, rollout_id: int
) -> tuple[TrainBatch, dict[str, float]]:
    """Score the samples with the planned stacks and turn rewards into advantages.

    The actor's own log-probs are recomputed only when needed: for several optimizer steps per
    rollout (the ratio is no longer 1) or for a KL reward penalty. The reference model runs only
    when KL is planned; the critic only when it exists.
    """
    from rlcore.algorithms.advantages import estimate_advantages  # torch, only when training

    needs_old = plan.actor.steps_per_rollout > 1 or plan.advantage.kl_coef != 0.0
    old_log_probs = tuple(stacks.actor.forward(samples)) if needs_old else ()
    ref_log_probs = tuple(stacks.reference.forward(samples)) if stacks.reference is not None else ()
    values = tuple(stacks.critic.forward(samples)) if stacks.critic is not None else ()
    adv = estimate_advantages(
        samples, plan.advantage, values=values, log_probs=old_log_probs, ref_log_probs=ref_log_probs
    )
    batch = TrainBatch(
        samples=tuple(samples),
        advantages=adv.advantages,
        returns=adv.returns if stacks.critic is not None else (),
        old_log_probs=old_log_probs if plan.actor.steps_per_rollout > 1 else (),
        ref_log_probs=ref_log_probs if plan.actor.loss.use_kl_loss else (),
        old_values=values,
        rollout_id=rollout_id,
    )
    return batch, {"rollout/kl_penalty": adv.kl}


def train(stacks: TrainStacks, batch: TrainBatch) -> dict[str, float]:
    """Critic first (it learns from this rollout's returns), then the actor."""
    metrics: dict[str, float] = {}
    if stacks.critic is not None:
        metrics.update(stacks.critic.train_step(batch).as_dict("train/critic"))
    metrics.update(stacks.actor.train_step(batch).as_dict("train/actor"))
    return metrics


def score(
    prompts: Sequence[Prompt], generations: Sequence[Generation], reward_fn: RewardFn, n: int
) -> list[Sample]:
    """Reward each generation; ``generations`` hold ``n`` consecutive samples per prompt."""
    group_prompts = [p for p in prompts for _ in range(n)]
    rewards = score_samples(group_prompts, generations, reward_fn)
    return [
        Sample(prompt=p, response=g, reward=r, group=i // n)
        for i, (p, g, r) in enumerate(zip(group_prompts, generations, rewards, strict=True))
    ]


def supervised_step(
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
    metrics = actor.train_step(batch).as_dict("train/actor")
    metrics.pop("train/actor/logprob_mismatch", None)  # the labels have no engine log-probs
    return {**metrics, "rollout/supervised": 1.0}


def rollout_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    return {
        "rollout/reward": _mean([s.reward for s in samples]),
        "rollout/response_len": _mean([float(len(s.response.token_ids)) for s in samples]),
        "rollout/truncated": _mean([float(s.response.finish_reason == "length") for s in samples]),
    }


# --------------------------------------------------------------------------------------------
# Runs


def build_stacks(plan: TrainPlan, backend: Backend) -> TrainStacks:
    return TrainStacks(
        actor=backend.build_training_stack(plan.actor),
        critic=backend.build_training_stack(plan.critic) if plan.critic is not None else None,
        reference=backend.build_eval_stack(plan.reference) if plan.reference is not None else None,
    )


def resume(plan: TrainPlan, stacks: TrainStacks) -> tuple[int, int]:
    """(first rollout id, prompts already consumed). Loads every training stack from ``plan.load``
    (the reference model keeps its initial weights); all must agree on the rollout id."""
    start = plan.start_rollout_id
    if plan.load is None:
        first = start or 0
        return first, first * plan.rollout_batch_size
    folder = find_checkpoint(plan.load)
    meta = read_meta(folder)
    ids = {name: stack.load(folder / name) for name, stack in stacks.training().items()}
    if any(i != meta.rollout_id for i in ids.values()):
        raise CheckpointError(
            f"stacks in {folder} disagree on the rollout id: {ids} "
            f"(checkpoint says {meta.rollout_id}); the checkpoint is mixed from different saves"
        )
    log.info("resumed from %s (rollout %d)", folder, meta.rollout_id)
    return (meta.rollout_id + 1 if start is None else start), meta.consumed_prompts


def run_training(
    plan: TrainPlan,
    backend: Backend,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    data: RunData,
    sink: MetricsSink,
) -> RunResult:
    stacks = build_stacks(plan, backend)
    start, consumed = resume(plan, stacks)
    sampler = PromptSampler(
        data.train_prompts, plan.rollout_batch_size, seed=data.seed, consumed=consumed
    )
    push_weights(stacks.actor, engine, version=start)

    trained: list[int] = []
    saved: list[int] = []
    evaluated: list[int] = []
    last_eval: dict[str, float] = {}
    last_train: dict[str, float] = {}

    def run_eval(after: int) -> None:
        nonlocal last_eval
        last_eval = evaluate(
            engine, reward_fn, data.eval_sets, plan.eval_params, plan.n_samples_per_eval_prompt
        )
        evaluated.append(after)
        sink.log(max(after + 1, start), last_eval)

    if plan.eval_before_train and data.eval_sets:
        run_eval(start - 1)

    for rollout_id in range(start, plan.num_rollout):
        t0 = time.perf_counter()
        prompts = sampler.next_batch()
        if rollout_id < plan.sft_warmup_rollouts:
            metrics, t1, t2 = supervised_step(prompts, stacks.actor, plan, rollout_id), t0, t0
        else:
            generations = generate(engine, prompts, plan.n_samples_per_prompt, plan.rollout_params)
            t1 = time.perf_counter()
            samples = score(prompts, generations, reward_fn, plan.n_samples_per_prompt)
            batch, adv_metrics = make_train_batch(samples, stacks, plan, rollout_id)
            t2 = time.perf_counter()
            metrics = {**rollout_metrics(samples), **adv_metrics, **train(stacks, batch)}
        trained.append(rollout_id)
        t3 = time.perf_counter()
        if should_save(rollout_id, plan.num_rollout, plan.save_interval, plan.save_dir is not None):
            assert plan.save_dir is not None
            meta = CheckpointMeta(rollout_id, sampler.consumed, tuple(stacks.training()))
            write_checkpoint(plan.save_dir, meta, _savers(stacks, rollout_id))
            saved.append(rollout_id)
        t4 = time.perf_counter()
        push_weights(stacks.actor, engine, version=rollout_id + 1)
        t5 = time.perf_counter()
        metrics.update(
            {
                "perf/generate_s": t1 - t0,
                "perf/advantages_s": t2 - t1,
                "perf/train_s": t3 - t2,
                "perf/save_s": t4 - t3,
                "perf/weight_sync_s": t5 - t4,
                "rollout/weight_version": float(rollout_id + 1),
            }
        )
        last_train = metrics
        sink.log(rollout_id, metrics)
        if data.eval_sets and should_eval(rollout_id, plan.num_rollout, plan.eval_interval):
            run_eval(rollout_id)
    return RunResult(
        tuple(trained), tuple(saved), tuple(evaluated), last_eval, last_train, stacks.built()
    )


def _savers(stacks: TrainStacks, rollout_id: int) -> dict[str, Callable[[Path], None]]:
    def saver(stack: TrainingStack) -> Callable[[Path], None]:
        return lambda folder: stack.save(folder, rollout_id)

    return {name: saver(stack) for name, stack in stacks.training().items()}


def run_eval_only(
    plan: EvalPlan,
    backend: Backend,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    data: RunData,
    sink: MetricsSink,
) -> RunResult:
    for line in plan.skipped:
        log.info("eval-only run, not built: %s", line)
    actor = backend.build_eval_stack(plan.actor)
    version = 0
    if plan.load is not None:
        folder = find_checkpoint(plan.load)
        version = actor.load(folder / "actor")
    push_weights(actor, engine, version=version)
    metrics = evaluate(
        engine, reward_fn, data.eval_sets, plan.eval_params, plan.n_samples_per_eval_prompt
    )
    sink.log(version, metrics)
    return RunResult((), (), (version,), metrics, {}, ("eval:actor",))


def run(
    plan: Plan,
    backend: Backend,
    engine: RolloutEngine,
    reward_fn: RewardFn,
    data: RunData,
    sink: MetricsSink | None = None,
) -> RunResult:
    """Run a planned job to the end. The match on the plan is exhaustive (checked by mypy)."""
    sink = sink or _NullSink()
    match plan:
        case EvalPlan():
            return run_eval_only(plan, backend, engine, reward_fn, data, sink)
        case TrainPlan():
            return run_training(plan, backend, engine, reward_fn, data, sink)
        case _:
            assert_never(plan)
