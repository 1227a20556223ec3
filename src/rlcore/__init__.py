"""rlcore: RL post-training for LLMs with a typed core.

``import rlcore`` is light (standard library, attrs, cattrs): the torch maths live in
:mod:`rlcore.algorithms`, the embedded engine in :mod:`rlcore.engines.embedded`, fakes in
:mod:`rlcore.testing`, and backends (``rlcore_megatron``) and rollout engines (``rlcore_sglang``)
are imported by name on demand.
"""

from __future__ import annotations

from rlcore.backends import load_backend
from rlcore.config import RunConfig
from rlcore.errors import (
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
from rlcore.loop import RunData, RunResult, run, should_eval, should_save
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
    WeightSink,
    WeightSource,
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
    "RunResult",
    "Sample",
    "SamplingParams",
    "Scheduler",
    "TrainBatch",
    "TrainMetrics",
    "TrainPlan",
    "TrainSpec",
    "TrainingStack",
    "WeightSink",
    "WeightSource",
    "load_backend",
    "load_config",
    "plan",
    "run",
    "should_eval",
    "should_save",
]
