"""What every training schedule does once a rollout is trained, written once: save (on the
interval, after the last rollout, and whenever the run is asked to stop early), export the actor
(``--save-hf``), and evaluate on the interval; the weight push between them is
:func:`~rlcore.loop.stages.push_weights`. The synchronous schedule (:mod:`rlcore.loop.training`)
runs them one after the other; the off-policy one (:mod:`rlcore.loop.overlap`) runs them while
its generator is held where the weights must not change under it."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from rlcore.checkpoint_files import rollout_number
from rlcore.loop.checkpoints import save_checkpoint
from rlcore.loop.hf_export import export_hf, should_export_hf
from rlcore.loop.plan import TrainPlan
from rlcore.loop.records import Progress
from rlcore.loop.stages import TrainStacks, evaluate, should_save
from rlcore.protocols.engine import RolloutEngine
from rlcore.protocols.metrics import MetricsSink
from rlcore.protocols.rollout import Group, RewardFn, RolloutOutput
from rlcore.samples import EvalSet

__all__ = ["Evaluation", "save_and_export", "wants_save"]


def wants_save(plan: TrainPlan, rollout_id: int, stopping: bool) -> bool:
    """Whether to save after rollout ``rollout_id``: on the save interval and after the last
    rollout (:func:`~rlcore.loop.stages.should_save`), and after any rollout when the run was
    asked to stop early (``stopping``), whenever the plan has a save folder."""
    saving = plan.save_dir is not None
    return should_save(rollout_id, plan.num_rollout, plan.save_interval, saving) or (
        stopping and saving
    )


def save_and_export(
    plan: TrainPlan,
    stacks: TrainStacks,
    rollout_id: int,
    progress: Progress,
    *,
    saving: bool,
    consumed: int,
    carried: tuple[Group, ...],
    pending: Mapping[int, RolloutOutput] | None = None,
    keep: Path | None = None,
) -> float:
    """The save stage when ``saving`` (:func:`~rlcore.loop.checkpoints.save_checkpoint` with
    the prompt position ``consumed``, the groups ``carried`` into the next rollout and those
    generated ahead, ``pending``; never removing ``keep``, the checkpoint the run loaded), then
    the Hugging Face export when it is due. Returns the seconds both took."""
    t0 = time.perf_counter()
    if saving:
        save_checkpoint(plan, stacks, rollout_id, consumed, carried, pending, keep=keep)
        progress.saved.append(rollout_id)
    if stacks.hf_exporter is not None and should_export_hf(plan, rollout_id):
        export_hf(plan, stacks.hf_exporter, rollout_id)
    return time.perf_counter() - t0


@attrs.frozen
class Evaluation:
    """The eval stage as a schedule calls it: every eval set with the engine
    (:func:`~rlcore.loop.stages.evaluate`), recorded in ``progress`` and logged at the number of
    rollouts trained (``after`` is the id of the last one, ``-1`` before any)."""

    plan: TrainPlan
    engine: RolloutEngine
    reward_fn: RewardFn
    eval_sets: Sequence[EvalSet]
    sink: MetricsSink
    progress: Progress

    def __call__(self, after: int) -> Mapping[str, float]:
        plan = self.plan
        metrics = evaluate(
            self.engine,
            self.reward_fn,
            self.eval_sets,
            plan.eval_params,
            plan.n_samples_per_eval_prompt,
        )
        self.progress.evaluated.append(after)
        self.sink.log(rollout_number(after), metrics)
        return metrics
