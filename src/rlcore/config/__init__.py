"""The run configuration: frozen attrs classes behind one cattrs converter, from flags with
slime's names or a TOML file.

- :mod:`~rlcore.config.run_config`: :class:`RunConfig` (every section) and :func:`check`, which
  composes the sections' checks.
- One module per group of sections, each with its own invariants beside it:
  :mod:`~rlcore.config.rollout` (``[rollout]``, ``[multiturn]``),
  :mod:`~rlcore.config.algorithm` (``[algorithm]``), :mod:`~rlcore.config.optim` (``[optim]``,
  ``[train]``), :mod:`~rlcore.config.cluster` (``[model]``, ``[cluster]``),
  :mod:`~rlcore.config.data` (``[data]``, ``[eval]``), :mod:`~rlcore.config.checkpoint`
  (``[checkpoint]``, ``[debug]``), :mod:`~rlcore.config.distill` (``[opd]``).
- :mod:`~rlcore.config.fields`: how a field declares its flag (:func:`option`) and how a problem
  names it.
- :mod:`~rlcore.config.convert`: the converter and how its errors name fields;
  :mod:`~rlcore.config.flags`: the command line and TOML files (:func:`load_config`).

Every field's metadata carries its flag and a one-line help text; the CLI is generated from them.
This room imports the shared types and :mod:`rlcore.engines`' registry (to check the engine a
config names); it imports no rollout machinery, algorithm or loop.
"""

from __future__ import annotations

from rlcore.config.algorithm import AlgorithmConfig
from rlcore.config.checkpoint import CheckpointConfig, DebugConfig
from rlcore.config.cluster import ClusterConfig, ModelConfig
from rlcore.config.convert import converter, structure_config, with_flag
from rlcore.config.data import DataConfig, EvalConfig, EvalDataConfig
from rlcore.config.distill import OPDConfig
from rlcore.config.fields import option
from rlcore.config.flags import build_parser, load_config, read_toml
from rlcore.config.optim import OptimizerConfig, TrainConfig
from rlcore.config.rollout import MultiTurnConfig, RolloutConfig
from rlcore.config.run_config import RunConfig, check, float_fields

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "DebugConfig",
    "EvalConfig",
    "EvalDataConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OPDConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "build_parser",
    "check",
    "converter",
    "float_fields",
    "load_config",
    "option",
    "read_toml",
    "structure_config",
    "with_flag",
]
