"""Backends found by name, imported on demand. ``rlcore`` never imports a backend package itself."""

from __future__ import annotations

import importlib

from rlcore.errors import BackendUnavailableError
from rlcore.protocols import Backend

__all__ = ["KNOWN_BACKENDS", "load_backend"]

KNOWN_BACKENDS: dict[str, tuple[str, str, str]] = {
    # name: (module, class, pip extra)
    "megatron": ("rlcore_megatron.backend", "MegatronBackend", "rlcore[megatron]"),
}


def load_backend(name: str) -> type[Backend]:
    """The backend class registered as ``name``; a clear install hint when its package is
    missing."""
    try:
        module_name, class_name, extra = KNOWN_BACKENDS[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown backend {name!r}; known: {', '.join(sorted(KNOWN_BACKENDS))}"
        ) from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"backend {name!r} needs packages that are not installed ({exc.name}): "
            f"pip install '{extra}'"
        ) from exc
    backend: type[Backend] = getattr(module, class_name)
    return backend
