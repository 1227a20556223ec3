"""The run: from a config to a plan, and from a plan to built stacks, rollouts, training steps,
checkpoints and evaluations.

- :mod:`~rlcore.loop.plan`: a :class:`~rlcore.config.RunConfig` becomes a ``TrainPlan``, an
  ``EvalPlan`` or a ``RolloutOnlyPlan``.
- :mod:`~rlcore.loop.stages`: the stages of a training run (build, resume, train, save, sync,
  eval), each a function; the rollout stage in :mod:`~rlcore.loop.rollouts`.
- :mod:`~rlcore.loop.training`: the synchronous schedule that arranges them;
  :mod:`~rlcore.loop.overlap` the off-policy one (``--max-staleness``), whose generator
  (:mod:`~rlcore.loop.generator`) runs the rollout stage ahead of training in a thread. What both
  do after a rollout is trained (save, export, evaluate) is written once, in
  :mod:`~rlcore.loop.tail`.
- :mod:`~rlcore.loop.jobs`: :func:`run`, eval-only and rollout-only jobs, the checks made before
  anything is built.
- :mod:`~rlcore.loop.records`: :class:`RunData`, :class:`RunResult`, :class:`RunInterrupted`.
- :mod:`~rlcore.loop.checkpoints`: the save and resume stages (atomic checkpoint folders, and
  what a resumed run may change), :mod:`~rlcore.loop.hf_export` (the actor as a Hugging Face
  folder, ``--save-hf``), :mod:`~rlcore.loop.contracts`
  (every call into a backend, stack or engine, checked), :mod:`~rlcore.loop.metrics` (sinks),
  :mod:`~rlcore.loop.preflight` (what the file system must hold before a run starts).

This room may import every room of rlcore below it; :mod:`rlcore.testing` stands beside it, the
launcher (:mod:`rlcore.launch`) above it.
"""

from __future__ import annotations

from rlcore.loop.checkpoints import resume_point
from rlcore.loop.jobs import check_inputs, run
from rlcore.loop.records import RunData, RunInterrupted, RunResult
from rlcore.loop.rollouts import RolloutSource, rollout_source
from rlcore.loop.stages import TrainStacks, evaluate, push_weights, should_eval, should_save

__all__ = [
    "RolloutSource",
    "RunData",
    "RunInterrupted",
    "RunResult",
    "TrainStacks",
    "check_inputs",
    "evaluate",
    "push_weights",
    "resume_point",
    "rollout_source",
    "run",
    "should_eval",
    "should_save",
]
