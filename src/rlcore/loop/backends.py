"""Backends found by name, imported on demand. ``rlcore`` never imports a backend package itself.

- :func:`load_backend`: the backend class (``rlcore.Backend``) for :func:`rlcore.run` with
  components of your own;
- :func:`execute`: a whole run of a :class:`~rlcore.config.RunConfig` on a backend, as its
  command line runs it (the checks before start, the cluster, the rollout engine, the run's
  files in ``--output-dir``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import cast

from rlcore.config import RunConfig
from rlcore.errors import BackendUnavailableError
from rlcore.loop.records import RunResult
from rlcore.protocols import Backend

__all__ = ["KNOWN_BACKENDS", "RUNNERS", "execute", "load_backend"]

KNOWN_BACKENDS: dict[str, tuple[str, str, str]] = {
    # name: (module, class, pip extra)
    "megatron": ("rlcore_megatron.backend", "MegatronBackend", "rlcore[megatron]"),
}
RUNNERS: dict[str, str] = {
    # name: the module whose ``execute(config, notes)`` runs a config as the command line does
    "megatron": "rlcore_megatron.run",
}

Runner = Callable[[RunConfig, Sequence[str]], RunResult]


def _module(name: str, module_name: str) -> ModuleType:
    """Backend ``name``'s module ``module_name``, or an install hint when it is missing."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        extra = KNOWN_BACKENDS[name][2]
        raise BackendUnavailableError(
            f"backend {name!r} needs packages that are not installed ({exc.name}): "
            f"pip install '{extra}'"
        ) from exc


def _known(name: str, registry: dict[str, object]) -> None:
    if name not in registry:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; known: {', '.join(sorted(registry))}"
        )


def load_backend(name: str) -> type[Backend]:
    """The backend class registered as ``name``; a clear install hint when its package is
    missing."""
    _known(name, dict(KNOWN_BACKENDS))
    module_name, class_name, _ = KNOWN_BACKENDS[name]
    backend: type[Backend] = getattr(_module(name, module_name), class_name)
    return backend


def execute(
    config: RunConfig, *, backend: str = "megatron", notes: Sequence[str] = ()
) -> RunResult:
    """Run ``config`` to the end on the backend named ``backend``, exactly as its command line
    (``python -m rlcore_megatron.run``) does: every check before anything starts, the data read
    once, the cluster, the ranks and the rollout engine built from the config, and the run's
    ``metrics.jsonl``, ``run.log`` and ``summary.json`` in ``config.output_dir`` (checkpoints in
    ``--save``). ``notes`` go to the run's log first (``load_config(..., report=notes)``).

    Raises :class:`~rlcore.errors.BackendUnavailableError` for an unknown backend or one whose
    packages are missing, what the checks find (:class:`~rlcore.errors.ConfigError`,
    :class:`~rlcore.errors.DataError`, ...) before anything starts, the rlcore error of a
    component that fails later, and :class:`~rlcore.loop.RunInterrupted` after Ctrl-C.
    """
    _known(backend, dict(RUNNERS))
    runner = cast(Runner, _module(backend, RUNNERS[backend]).execute)
    return runner(config, notes)
