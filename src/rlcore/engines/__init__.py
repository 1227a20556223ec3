"""Rollout engines found by name (``--rollout-engine NAME``), the way backends are.

An engine package describes itself with an :class:`EngineKind`: its name, its options (an attrs
class whose fields carry their flags, declared with :func:`rlcore.config.option`; the run's
``--help`` lists them under the engine's name, and a config file sets them in a section of that
name, ``[sglang]``), whether it runs servers that the run's placement must find room for, and how
to build it from an :class:`EngineSetup`. :data:`KNOWN_ENGINES` says where each kind lives; the
module it names stays light (no torch), so that ``--help`` works without the engine's
dependencies and a missing package is a clear error with an install hint.

Why the options live with the engine and not in :class:`~rlcore.config.RunConfig`: the core cannot
name the fields of engines it does not know, and each engine checks its own settings. The config
holds the chosen engine's options as an opaque value (``RolloutConfig.engine_options``) that
:func:`rlcore.config.flags.load_config` builds from the flags or the section, and that the engine's
kind type-checks when it builds the engine.

The embedded engine (``embedded``, the default) runs in the calling process and has no options.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar, final

import attrs

from rlcore.errors import BackendUnavailableError
from rlcore.imports import NoOptions, Registry, kind_options, load_registered
from rlcore.protocols.engine import RolloutEngine, TeacherServer
from rlcore.protocols.hosts import ProcessHost
from rlcore.protocols.tokenizer import Tokenizer
from rlcore.specs import Precision

__all__ = ["EMBEDDED", "KNOWN_ENGINES", "EngineKind", "EngineSetup", "NoOptions", "load_engine"]

OptionsT = TypeVar("OptionsT")


@final
@attrs.frozen
class EngineSetup:
    """What a run hands an engine's builder."""

    model_path: Path
    """The Hugging Face folder the policy starts from (``--hf-checkpoint``)."""
    tokenizer: Tokenizer
    seed: int
    log_dir: Path
    """Where the engine may write logs (its servers' logs, for example)."""
    hosts: tuple[ProcessHost, ...] = ()
    """One place per server, reserved by the run's placement (``--rollout-num-gpus``); empty
    when the engine runs no servers (or the caller did not place any)."""
    dtype: Precision = "float32"
    """The trainer's precision (``--bf16``): the engine holds its weights in it, so that synced
    weights arrive unconverted and its log-probs compare with the trainer's."""
    fault_tolerance: bool = False
    """``--use-fault-tolerance``: restart a server that dies or stops answering and resubmit its
    requests (engines that run servers; the run refuses it for the others)."""


@final
@attrs.frozen
class EngineKind(Generic[OptionsT]):
    """A rollout engine as the run finds it by name."""

    name: str
    options_type: type[OptionsT]
    """Its settings: an attrs class with flag metadata (:func:`rlcore.config.option`)."""
    builder: Callable[[EngineSetup, OptionsT], RolloutEngine]
    runs_servers: Callable[[OptionsT], bool]
    """Whether, with these options, it starts servers on hosts the run's placement reserves."""
    install: str = "rlcore"
    """What to ``pip install`` when its packages are missing."""
    connect_teacher: Callable[[str, float], tuple[TeacherServer, Path | None]] | None = None
    """A distillation teacher served by this engine's kind of server (``--opd-type NAME
    --opd-teacher-url URL``): connect to the server at the URL, waiting up to the timeout (s) for
    it to answer (else :class:`~rlcore.errors.RolloutError` saying how to start one), and return
    it with the model folder it serves when this machine can read it. ``None``: this engine serves
    no teacher."""

    def options(self, options: object | None) -> OptionsT:
        """``options`` as this engine's options type (its defaults for ``None``)."""
        return kind_options(self.options_type, options, f"engine {self.name!r}")

    def build(self, setup: EngineSetup, options: object | None) -> RolloutEngine:
        """Build the engine; a missing dependency is a :class:`BackendUnavailableError`."""
        try:
            return self.builder(setup, self.options(options))
        except ImportError as exc:
            raise BackendUnavailableError(
                f"rollout engine {self.name!r} needs packages that are not installed "
                f"({exc.name}): pip install '{self.install}'"
            ) from exc


def _build_embedded(setup: EngineSetup, options: NoOptions) -> RolloutEngine:
    del options
    import torch
    from transformers.utils import logging as hf_logging

    from rlcore.engines.embedded import EmbeddedEngine

    # "Loading weights" bars on every run say nothing a user needs.
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # transformers: unannotated
    return EmbeddedEngine.from_pretrained(
        setup.model_path,
        setup.tokenizer,
        seed=setup.seed,
        dtype=torch.bfloat16 if setup.dtype == "bfloat16" else torch.float32,
    )


EMBEDDED: EngineKind[NoOptions] = EngineKind(
    "embedded", NoOptions, _build_embedded, lambda _: False, "rlcore[torch]"
)
"""Hugging Face transformers sampling in the calling process: no servers, no options."""

KNOWN_ENGINES: Registry = {
    # name: (module, attribute holding its EngineKind, pip extra)
    "embedded": ("rlcore.engines", "EMBEDDED", "rlcore[torch]"),
    "sglang": ("rlcore_sglang.kind", "SGLANG", "rlcore[sglang]"),
}


def load_engine(name: str) -> EngineKind[Any]:
    """The engine kind registered as ``name``; a clear install hint when its package is
    missing."""
    kind: EngineKind[Any] = load_registered(KNOWN_ENGINES, name, "rollout engine")
    return kind
