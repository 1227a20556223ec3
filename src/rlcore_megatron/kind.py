"""``--train-backend megatron`` as the launcher finds it (:data:`MEGATRON`, registered in
:data:`rlcore.backends.KNOWN_BACKENDS`). Light: Megatron is imported on a rank, when the runtime
initialises it, never by the checks before start."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, final

import attrs

from rlcore.backends import BackendKind
from rlcore.errors import ConfigError, ConfigProblem
from rlcore.protocols.stacks import Backend
from rlcore.specs import ParallelSpec
from rlcore_megatron.model.arch import arch_from_hf_config, model_info
from rlcore_megatron.options import MegatronOptions

__all__ = ["MEGATRON", "MegatronRuntime"]


@final
@attrs.frozen
class MegatronRuntime:
    """:func:`~rlcore_megatron.parallel.init_megatron`, then a
    :class:`~rlcore_megatron.backend.MegatronBackend` with ``options``; both imported inside
    the rank."""

    options: MegatronOptions = MegatronOptions()

    def init(self, parallel: ParallelSpec, seed: int) -> None:
        from rlcore_megatron.parallel import init_megatron

        init_megatron(parallel.tensor, seed, parallel.expert)

    def backend(self) -> Backend:
        from rlcore_megatron.backend import MegatronBackend

        return MegatronBackend(options=self.options)


def model_problems(hf_config: Mapping[str, Any], source: str) -> list[ConfigProblem]:
    """What :mod:`rlcore_megatron.model.arch` (which imports no Megatron) cannot build in the
    ``config.json`` read from ``source``."""
    try:
        arch_from_hf_config(dict(hf_config), source)
    except ConfigError as exc:
        return list(exc.problems)
    return []


def saved_model_problem(stack: Path, hf_config: Mapping[str, Any], source: str) -> str | None:
    """The model a stack's ``rollout.json`` records with its saved weights against the one
    ``hf_config`` builds (say the folder was since replaced by another model)."""
    record = stack / "rollout.json"
    try:
        saved = json.loads(record.read_text())["model"]
        if not isinstance(saved, dict):
            raise TypeError(f"model is of type {type(saved).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{record} cannot be read: {exc}"
    here = model_info(arch_from_hf_config(dict(hf_config), source), "teacher")
    wrong = sorted(k for k in here if saved.get(k) != here[k])
    if not wrong:
        return None
    return f"{stack} holds weights of another shape than {source} describes: " + ", ".join(
        f"{k} is {saved.get(k)!r} there, {here[k]!r} in the folder" for k in wrong
    )


def parallel_problem(parallel: ParallelSpec) -> str | None:
    """This backend splits a model by tensor and expert parallel (and data parallel over the
    rest); it builds each model whole on those ranks, so it refuses pipeline stages."""
    if parallel.pipeline > 1:
        return (
            f"the megatron backend does not cut a model into pipeline stages (asked for "
            f"{parallel.pipeline}): it builds every layer on each tensor-parallel group"
        )
    return None


def options_model_problems(
    options: MegatronOptions, hf_config: Mapping[str, Any]
) -> list[ConfigProblem]:
    """``--recompute-num-layers`` against the model's layers
    (:meth:`~rlcore_megatron.options.MegatronOptions.num_layers_problem`)."""
    arch = arch_from_hf_config(dict(hf_config))
    problem = options.num_layers_problem(arch.num_layers)
    return [] if problem is None else [problem]


MEGATRON: Final[BackendKind[MegatronOptions]] = BackendKind(
    name="megatron",
    options_type=MegatronOptions,
    runtime=MegatronRuntime,
    model_problems=model_problems,
    saved_model_problem=saved_model_problem,
    parallel_problem=parallel_problem,
    install="rlcore[megatron]",
    options_model_problems=options_model_problems,
)
"""Megatron-core over Ray ranks: Llama 3, Qwen2.5, Qwen3 and Qwen3-MoE from their HF folders."""
