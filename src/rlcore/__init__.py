"""rlcore: RL post-training for LLMs with a typed core.

The rooms, from the ground up (a room imports only the rooms below it; ``nox -s lint`` checks
it):

- shared types: :mod:`rlcore.errors`, :mod:`rlcore.samples` (prompts, generations, samples,
  batches), :mod:`rlcore.specs` (what a backend is asked to build), :mod:`rlcore.weights` (weights
  on their way to an engine), :mod:`rlcore.protocols` (stacks, backends, engines, rewards,
  tokenizers, the rollout seam), :mod:`rlcore.checkpoint_files` (a checkpoint folder's layout),
  :mod:`rlcore.imports` (a user's ``module:function``), :mod:`rlcore.logits` (where the sampling
  temperature meets the logits, for the engines and the trainer alike);
- the middle: :mod:`rlcore.data` (prompt files, tokenizers, the prompt stream),
  :mod:`rlcore.rollout` (the default rollout, rewards, multi-turn episodes, tools, replay),
  :mod:`rlcore.engines` (rollout engines by name, the embedded engine), :mod:`rlcore.algorithms`
  (the torch maths: advantages, losses, KL), :mod:`rlcore.new_model` (a small model folder of
  your own from scratch: ``python -m rlcore.new_model``);
  :mod:`rlcore.backends` (training backends by name, each described by its kind);
- :mod:`rlcore.config`: the run configuration, flags and TOML;
- :mod:`rlcore.loop`: the plan, the stages of a run and their schedule, checkpoints, metrics;
- beside the loop, :mod:`rlcore.testing`: fakes for tests;
- on top, :mod:`rlcore.launch` (the launcher: the command line, the checks before start, Ray's
  side, the run record, the demos), :mod:`rlcore.plot` (a run's curves from its
  ``metrics.jsonl``: ``python -m rlcore.plot``) and :mod:`rlcore.backend_api` (what a backend
  author implements and may reuse).

This package's names are for users who run training: configs, plans, :func:`run` and
:func:`execute`, the rollout seam, multi-turn environments, the errors. A backend is written
against :mod:`rlcore.backend_api`. ``import rlcore`` is light (standard library, attrs, cattrs):
the torch maths and the embedded engine import torch on demand, and backends
(``rlcore_megatron``) and rollout engines (``rlcore_sglang``) are imported by name.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlcore.backends import load_backend
from rlcore.config import RunConfig, load_config
from rlcore.errors import (
    BackendContractError,
    BackendError,
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    ConfigProblem,
    DataError,
    PlanError,
    RewardError,
    RLCoreError,
    RolloutError,
)
from rlcore.loop import RunData, RunInterrupted, RunResult, run, should_eval, should_save
from rlcore.loop.plan import EvalPlan, Plan, RolloutOnlyPlan, RolloutSpec, TrainPlan, plan
from rlcore.protocols.engine import RolloutEngine
from rlcore.protocols.metrics import MetricsSink
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
from rlcore.rollout import check_reward_nonzero_std, default_rollout
from rlcore.rollout.environments import Environment, EnvironmentFactory, StepResult
from rlcore.rollout.multiturn import EpisodeEngine, GenerateContext
from rlcore.rollout.replay import load_rollout_data, save_rollout_data
from rlcore.rollout.tools import Tool, ToolEnvironment
from rlcore.samples import (
    EvalSet,
    Generation,
    Prompt,
    Sample,
    SamplingParams,
    Turn,
)
from rlcore.specs import AdvantageSpec


def execute(config: RunConfig, notes: Sequence[str] = ()) -> RunResult:
    """Run ``config`` to the end exactly as its command line (``python -m rlcore.launch``) does,
    on the backend it names (``--train-backend``): every check before anything starts, the data
    read once, Ray, the backend's ranks and the rollout engine built from the config, and the
    run's ``metrics.jsonl``, ``run.log`` and ``summary.json`` in ``config.output_dir``. ``notes``
    go to the run's log first (``load_config(..., report=notes)``). See
    :func:`rlcore.launch.cli.execute` (imported here on use: ``import rlcore`` stays light)."""
    from rlcore.launch.cli import execute as launch

    return launch(config, notes)


__version__ = "0.1.0"

__all__ = [
    "AdvantageSpec",
    "BackendContractError",
    "BackendError",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "ConfigProblem",
    "DataError",
    "DynamicSampling",
    "Environment",
    "EnvironmentFactory",
    "EpisodeEngine",
    "EvalPlan",
    "EvalSet",
    "GenerateContext",
    "Generation",
    "Group",
    "GroupFilter",
    "MetricsSink",
    "Plan",
    "PlanError",
    "Prompt",
    "PromptSource",
    "RLCoreError",
    "RewardError",
    "RewardFn",
    "RolloutContext",
    "RolloutEngine",
    "RolloutError",
    "RolloutFn",
    "RolloutOnlyPlan",
    "RolloutOutput",
    "RolloutSpec",
    "RunConfig",
    "RunData",
    "RunInterrupted",
    "RunResult",
    "Sample",
    "SamplingParams",
    "StepResult",
    "Tool",
    "ToolEnvironment",
    "TrainPlan",
    "Turn",
    "check_reward_nonzero_std",
    "default_rollout",
    "execute",
    "load_backend",
    "load_config",
    "load_rollout_data",
    "plan",
    "run",
    "save_rollout_data",
    "should_eval",
    "should_save",
]
