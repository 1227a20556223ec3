"""The off-policy training schedule: generation runs ahead of training (``--max-staleness K``).

The stages are the synchronous schedule's (:mod:`rlcore.loop.stages`); what changes is who waits.
A :class:`~rlcore.loop.generator.RolloutGenerator` runs the rollout seam in a thread of its own,
up to ``K`` policy versions ahead, while the trainer trains::

    generator:  rollout j+1 (weights j+1-K) | rollout j+2 ...
    trainer:    train j | save | push weights j+1 | eval | train j+1 ...

- ``K = 1``, one-step off-policy: rollout ``j + 1`` is generated with weights ``j`` while step ``j``
  trains. The weights of step ``j`` are pushed once rollout ``j + 1`` is done, so every rollout is
  generated with one known version and two runs with the same seed give the same metrics.
- ``K > 1``: the generator runs freely, as far as ``K`` versions ahead. With
  ``--partial-rollout`` new weights interrupt it at a token boundary
  (:class:`~rlcore.protocols.engine.PartialRolloutEngine`) and it goes on with them. Without, a
  step's weights go to the engine only between two of its rollouts: when the generator is
  mid-rollout they are deferred (``rollout/weights_deferred``) and the next step's go instead,
  unless a save, an evaluation or the end of the run needs them now (then they wait for the rollout
  to end).

Evaluations and saves hold the generator between rollouts. A save keeps the rollouts generated
ahead of training with the checkpoint, so a resumed run trains on exactly them (a ``K = 1`` run
resumes exactly). No sample is trained on more than ``K`` versions after the version that made
its first token: the generator starts rollout ``j`` only once version ``j - K`` is published, and
drops carried groups that would be older (``rollout/stale_dropped``).

**Off-policy correction.** A sample of rollout ``j`` was drawn from a behaviour policy ``mu``
(the engine's weights, version ``>= j - K``), whose per-token log-probs the engine recorded. The
loss is the decoupled PPO objective (Hilton et al. 2021, arXiv:2110.00641; AReaL, Fu et al.
2025, arXiv:2505.24298): with ``pi_prox`` the trainer's policy at the start of the step (the
recomputed old log-probs) and ``pi_theta`` the one being optimised,

    L = -E_mu[ w_t * min(r_t * A_t, clip(r_t, 1 - eps, 1 + eps_high) * A_t) ],
    r_t = pi_theta(y_t) / pi_prox(y_t),   w_t = correct(pi_prox(y_t) / mu(y_t)),

where ``correct`` is the importance-sampling correction of ``--use-tis`` (TIS clip, IcePop mask,
geometric, veto: :mod:`rlcore.algorithms.correction`), which ``--max-staleness`` turns on. PPO's
trust region is measured from ``pi_prox``, and ``w`` carries the off-policyness, so a stale sample
is reweighted, not trusted.

Metrics per rollout: ``rollout/staleness_mean`` and ``rollout/staleness_max`` (trainer version
minus each sample's first-token version), ``rollout/stale_dropped``, ``perf/trainer_idle_s`` (the
trainer waiting for the rollout), ``perf/engine_idle_s`` (the generator waiting before it).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping

from rlcore.checkpoint_files import rollout_number
from rlcore.data.sampler import PromptSampler
from rlcore.errors import PlanError
from rlcore.loop.checkpoints import resume
from rlcore.loop.generator import Produced, RolloutGenerator
from rlcore.loop.plan import TrainPlan
from rlcore.loop.records import Progress, RunData, RunResult
from rlcore.loop.rollouts import rollout_source
from rlcore.loop.stages import (
    build_stacks,
    push_weights,
    should_eval,
    train_on_rollout,
    training_samples,
    warm_start,
)
from rlcore.loop.tail import Evaluation, save_and_export, wants_save
from rlcore.protocols.engine import RolloutEngine, TeacherServer, takes_weights_midway
from rlcore.protocols.metrics import MetricsSink
from rlcore.protocols.rollout import RewardFn, RolloutFn
from rlcore.protocols.stacks import Backend

__all__ = ["run_overlapped_training", "staleness_metrics"]


def staleness_metrics(produced: Produced, trainer_version: int) -> dict[str, float]:
    """How far behind the trainer's version the rollout's samples were generated."""
    lags = [
        trainer_version - s.response.first_weight_version
        for s in training_samples(produced.output.groups)
    ]
    return {
        "rollout/staleness_mean": math.fsum(lags) / len(lags) if lags else 0.0,
        "rollout/staleness_max": float(max(lags, default=0)),
        "rollout/stale_dropped": float(produced.stale_dropped),
    }


def run_overlapped_training(
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
    """Train ``plan`` with the off-policy schedule (module docstring). What has been done is kept
    in ``progress``, for Ctrl-C to report.

    ``plan.max_staleness`` 0 and 1 are lockstep: before version ``v`` is published the generator
    has produced every rollout that version ``v - 1`` may generate (up to ``v - 1 + K``), so each
    rollout is generated with exactly one known version. With 0 that is the synchronous schedule
    in a thread (:func:`rlcore.loop.jobs.run` takes :func:`~rlcore.loop.training.run_training`
    instead; the tests compare the two); above 1 the generator runs free.
    """
    if engine is None:
        raise PlanError("an off-policy schedule generates ahead of training: it needs an engine")
    if plan.partial_rollout and not takes_weights_midway(engine):
        raise PlanError(
            f"--partial-rollout: the rollout engine {type(engine).__name__} cannot take new "
            "weights mid-generation (rlcore.protocols.PartialRolloutEngine); use the embedded "
            "or SGLang engine, or drop --partial-rollout"
        )
    produce = rollout_source(plan, engine, reward_fn, rollout_fn, teacher)
    stacks = build_stacks(plan, backend)
    progress.built = stacks.built()
    resumed = resume(plan, stacks)
    start = resumed.first
    sampler = PromptSampler(
        data.train_prompts, plan.rollout_batch_size, seed=data.seed, consumed=resumed.consumed
    )
    push_weights(stacks.actor, engine, start, keeps=False)
    first_generated = max(start, plan.sft_warmup_rollouts)
    generator = RolloutGenerator(
        produce,
        sampler,
        first=first_generated,
        end=plan.num_rollout,
        max_staleness=plan.max_staleness,
        published=start,
        carried=resumed.carried,
        ready=resumed.pending,
    )

    run_eval = Evaluation(plan, engine, reward_fn, data.eval_sets, sink, progress)
    # Evaluated before the generator starts, so that it always comes first.
    last_eval: Mapping[str, float] = run_eval(start - 1) if plan.eval_before_train else {}
    last_train: Mapping[str, float] = {}
    lockstep = plan.max_staleness <= 1
    published = start
    try:
        if first_generated == start:
            generator.start()
        for rollout_id in range(start, plan.num_rollout):
            progress.current = rollout_id
            t0 = time.perf_counter()
            if rollout_id < plan.sft_warmup_rollouts:
                metrics = warm_start(sampler.next_batch(), stacks.actor, plan, rollout_id)
                if rollout_id + 1 == first_generated:
                    # The warm start has taken its prompts: the generator may use the sampler.
                    generator.start()
                metrics["perf/train_s"] = time.perf_counter() - t0
            else:
                produced, waited = generator.take(rollout_id)
                progress.rollouts.append(rollout_id)
                metrics = train_on_rollout(plan, stacks, rollout_id, produced.output)
                metrics.update(staleness_metrics(produced, rollout_id))
                metrics["perf/generate_s"] = produced.generate_s
                metrics["perf/trainer_idle_s"] = waited
                metrics["perf/engine_idle_s"] = produced.engine_idle_s
            progress.trained.append(rollout_id)
            version = rollout_id + 1
            stopping = progress.stop.is_set()  # asked to stop early: save this rollout, stop
            saving = wants_save(plan, rollout_id, stopping)
            evaluating = should_eval(rollout_id, plan.num_rollout, plan.eval_interval)
            with contextlib.ExitStack() as hold:
                try:
                    pushing = True
                    if lockstep:  # wait for the rollouts the old weights still owe
                        hold.enter_context(generator.held(through=version - 1 + plan.max_staleness))
                    elif not plan.partial_rollout:
                        # New weights wait for the generator to finish its rollout only when they
                        # must go out now; otherwise, mid-rollout, the next step's go instead.
                        urgent = saving or evaluating or version == plan.num_rollout
                        pushing = hold.enter_context(generator.held(wait=urgent))
                    elif saving or evaluating:
                        hold.enter_context(generator.held())
                    metrics["perf/save_s"] = save_and_export(
                        plan,
                        stacks,
                        rollout_id,
                        progress,
                        saving=saving,
                        consumed=sampler.consumed,
                        carried=generator.carried,
                        pending=generator.pending(),
                        keep=resumed.loaded,
                    )
                    t2 = time.perf_counter()
                    if pushing:
                        midway = plan.partial_rollout  # new weights interrupt generation
                        push_weights(stacks.actor, engine, version, keeps=False, midway=midway)
                        generator.publish(version)
                        published = version
                    metrics["perf/weight_sync_s"] = time.perf_counter() - t2
                    metrics["rollout/weight_version"] = float(published)
                    metrics["rollout/weights_deferred"] = float(not pushing)
                finally:
                    last_train = metrics
                    sink.log(rollout_number(rollout_id), metrics)
                if evaluating:
                    last_eval = run_eval(rollout_id)
            if stopping:
                break
    finally:
        generator.close()
    return progress.finished(plan.num_rollout, last_eval, last_train)
