"""rlcore: RL post-training for LLMs with a typed core.

``import rlcore`` is light (standard library, attrs, cattrs): the torch maths live in
:mod:`rlcore.algorithms`, the embedded engine in :mod:`rlcore.engines.embedded`, fakes in
:mod:`rlcore.testing`, and backends (``rlcore_megatron``) and rollout engines (``rlcore_sglang``)
are imported by name on demand.
"""

from __future__ import annotations

from rlcore.backends import load_backend
from rlcore.config import RunConfig
from rlcore.environments import Environment, EnvironmentFactory, StepResult
from rlcore.errors import (
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
from rlcore.flags import load_config
from rlcore.loop import RunData, RunInterrupted, RunResult, run, should_eval, should_save
from rlcore.multiturn import EpisodeEngine, GenerateContext
from rlcore.plan import EvalPlan, Plan, RolloutOnlyPlan, TrainPlan, plan
from rlcore.protocols import (
    Backend,
    EvalStack,
    GroupFilter,
    MetricsSink,
    NamedTensors,
    Optimizer,
    PromptSource,
    RewardFn,
    RolloutEngine,
    RolloutFn,
    Scheduler,
    TrainingStack,
    WeightSink,
    WeightSource,
)
from rlcore.replay import load_rollout_data, save_rollout_data
from rlcore.rollout import (
    DynamicSampling,
    Group,
    RolloutContext,
    RolloutOutput,
    RolloutSpec,
    check_reward_nonzero_std,
    default_rollout,
)
from rlcore.samples import (
    EvalSet,
    Generation,
    Prompt,
    Sample,
    SamplingParams,
    TrainBatch,
    TrainMetrics,
    Turn,
)
from rlcore.specs import (
    AdvantageSpec,
    EvalSpec,
    ISCorrection,
    LossSpec,
    LRSchedule,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    TrainSpec,
)
from rlcore.tools import Tool, ToolEnvironment

__version__ = "0.1.0"

__all__ = [
    "AdvantageSpec",
    "Backend",
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
    "EvalSpec",
    "EvalStack",
    "GenerateContext",
    "Generation",
    "Group",
    "GroupFilter",
    "ISCorrection",
    "LRSchedule",
    "LossSpec",
    "MetricsSink",
    "ModelSpec",
    "NamedTensors",
    "Optimizer",
    "OptimizerSpec",
    "ParallelSpec",
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
    "Scheduler",
    "StepResult",
    "Tool",
    "ToolEnvironment",
    "TrainBatch",
    "TrainMetrics",
    "TrainPlan",
    "TrainSpec",
    "TrainingStack",
    "Turn",
    "WeightSink",
    "WeightSource",
    "check_reward_nonzero_std",
    "default_rollout",
    "load_backend",
    "load_config",
    "load_rollout_data",
    "plan",
    "run",
    "save_rollout_data",
    "should_eval",
    "should_save",
]
