"""``--train-backend fsdp`` as the launcher finds it (:data:`FSDP`, registered in
:data:`rlcore.backends.KNOWN_BACKENDS`). Light: torch is imported on a rank, when the runtime
initialises it; the model check before start reads the folder's ``config.json`` with
transformers' ``AutoConfig`` tables (importing transformers, not building anything).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, final

import attrs

from rlcore.backends import BackendKind
from rlcore.errors import ConfigProblem
from rlcore.protocols.stacks import Backend
from rlcore.specs import ParallelSpec
from rlcore_fsdp.options import (
    FSDPOptions,
    model_owner,
    model_record,
    parallel_problem,
)

__all__ = ["FSDP", "FSDPRuntime"]


@final
@attrs.frozen
class FSDPRuntime:
    """One rank: :func:`rlcore.algorithms.distributed.init_process_group` over the data-parallel
    ranks and the seeds, then an :class:`~rlcore_fsdp.backend.FSDPBackend` (both imported inside
    the rank)."""

    options: FSDPOptions = FSDPOptions()

    def init(self, parallel: ParallelSpec, seed: int) -> None:
        from rlcore_fsdp.backend import init_rank

        init_rank(parallel, seed, self.options.fsdp_cpu_offload)

    def backend(self) -> Backend:
        from rlcore_fsdp.backend import FSDPBackend

        return FSDPBackend(self.options)


def model_problems(hf_config: Mapping[str, Any], source: str) -> list[ConfigProblem]:
    """Whether transformers knows the ``config.json`` read from ``source`` as a causal LM: its
    ``model_type`` is one transformers builds with ``AutoModelForCausalLM``, or the folder ships
    its own code for it (``auto_map``; the rank then needs ``--trust-remote-code``)."""
    from transformers.models.auto.configuration_auto import (  # type: ignore[attr-defined]  # transformers does not list it in __all__
        CONFIG_MAPPING_NAMES,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = hf_config.get("model_type")
    auto_map = hf_config.get("auto_map")
    if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
        return []
    if not isinstance(model_type, str):
        return [
            ConfigProblem(
                "model_type",
                f"{source} names no model_type, so transformers' AutoConfig cannot read it",
                "use a Hugging Face model folder (its config.json names the model_type)",
            )
        ]
    if model_type not in CONFIG_MAPPING_NAMES:
        return [
            ConfigProblem(
                "model_type",
                f"transformers does not know model_type {model_type!r} ({source})",
                "upgrade transformers, or use a folder that ships its code (auto_map) with "
                "--trust-remote-code",
            )
        ]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return [
            ConfigProblem(
                "model_type",
                f"transformers has no causal LM (AutoModelForCausalLM) for model_type "
                f"{model_type!r} ({source})",
                "the fsdp backend trains causal language models",
            )
        ]
    return []


def saved_model_problem(stack: Path, hf_config: Mapping[str, Any], source: str) -> str | None:
    """The model a stack's ``rollout.json`` records against the one ``hf_config`` describes (say
    the folder was since replaced by another model); the head is not compared (the launcher
    asks about the actor's)."""
    record = stack / "rollout.json"
    try:
        saved = json.loads(record.read_text())["model"]
        if not isinstance(saved, dict):
            raise TypeError(f"model is of type {type(saved).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{record} cannot be read: {exc}"
    here = model_record(hf_config, "actor")
    del here["head"]
    wrong = sorted(k for k in here if saved.get(k) != here[k])
    if not wrong:
        return None
    return f"{stack} holds weights of another shape than {source} describes: " + ", ".join(
        f"{k} is {saved.get(k)!r} there, {here[k]!r} in the folder" for k in wrong
    )


FSDP: Final[BackendKind[FSDPOptions]] = BackendKind(
    name="fsdp",
    options_type=FSDPOptions,
    runtime=FSDPRuntime,
    model_problems=model_problems,
    saved_model_problem=saved_model_problem,
    parallel_problem=parallel_problem,
    install="rlcore[fsdp]",
    model_owner=model_owner,
)
"""Any Hugging Face causal LM (``AutoModelForCausalLM``), sharded with FSDP2 over the
data-parallel ranks."""
