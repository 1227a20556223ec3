"""rlcore: RL post-training for LLMs with a typed core.

``import rlcore`` is light (standard library, attrs, cattrs): the torch maths live in
:mod:`rlcore.algorithms`, engines in :mod:`rlcore.engines`, fakes in :mod:`rlcore.testing`, and
backends such as ``rlcore_megatron`` are imported by name on demand.
"""

from __future__ import annotations

from rlcore.backends import load_backend
from rlcore.config import RunConfig
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
from rlcore.plan import EvalPlan, Plan, TrainPlan, plan
from rlcore.protocols import (
    Backend,
    EvalStack,
    MetricsSink,
    NamedTensors,
    Optimizer,
    RewardFn,
    RolloutEngine,
    Scheduler,
    TrainingStack,
)
from rlcore.samples import (
    EvalSet,
    Generation,
    Prompt,
    Sample,
    SamplingParams,
    TrainBatch,
    TrainMetrics,
)
from rlcore.specs import (
    AdvantageSpec,
    EvalSpec,
    LossSpec,
    LRSchedule,
    ModelSpec,
    OptimizerSpec,
    ParallelSpec,
    TrainSpec,
)

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
    "EvalPlan",
    "EvalSet",
    "EvalSpec",
    "EvalStack",
    "Generation",
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
    "RLCoreError",
    "RewardError",
    "RewardFn",
    "RolloutEngine",
    "RolloutError",
    "RunConfig",
    "RunData",
    "RunInterrupted",
    "RunResult",
    "Sample",
    "SamplingParams",
    "Scheduler",
    "TrainBatch",
    "TrainMetrics",
    "TrainPlan",
    "TrainSpec",
    "TrainingStack",
    "load_backend",
    "load_config",
    "plan",
    "run",
    "should_eval",
    "should_save",
]
