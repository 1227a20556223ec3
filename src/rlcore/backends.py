"""Training backends found by name (``--train-backend NAME``), the way rollout engines are.

A backend package describes itself with a :class:`BackendKind`: its name; its options (an attrs
class whose fields carry their flags, declared with :func:`rlcore.config.option`: ``--help``
lists them under the backend's name and a config file sets them in a section of that name);
the rank runtime that sets up one rank's process group and parallel state and then builds that
rank's stacks; the checks the launcher asks before anything starts (whether the backend can
build a model folder's ``config.json``, whether a checkpoint's saved weights fit a model folder,
whether it supports a parallel layout); which eval stacks are views of a training stack's model
rather than models of their own (:attr:`BackendKind.model_owner`); and the pip extra that
installs it.
:data:`KNOWN_BACKENDS` says where each kind lives; the module it names stays light (no torch, no
framework), so that ``--help`` and the checks before start need only rlcore, and a missing
package is a clear error with an install hint (:func:`rlcore.imports.load_registered`, which the
engines' registry shares).

Nothing in rlcore imports a backend package: the launcher asks this registry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, final

import attrs

from rlcore.errors import ConfigProblem
from rlcore.imports import Registry, kind_options, load_registered
from rlcore.protocols.stacks import Backend
from rlcore.specs import EvalSpec, ParallelSpec, Role

__all__ = ["KNOWN_BACKENDS", "BackendKind", "RankRuntime", "load_backend", "load_backend_kind"]

OptionsT = TypeVar("OptionsT")


class RankRuntime(Protocol):
    """What runs in each rank's process before its stacks exist. Must be picklable: a launcher
    ships it to every rank (a Ray actor, a ``torchrun`` worker).

    :meth:`init` is called on every rank of a group at once, with ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` already in ``os.environ``: it
    joins the process group and sets up the parallel state ``parallel`` describes, seeded with
    ``seed``. :meth:`backend` then builds the rank's stacks."""

    def init(self, parallel: ParallelSpec, seed: int) -> None: ...

    def backend(self) -> Backend: ...


@final
@attrs.frozen
class BackendKind(Generic[OptionsT]):
    """A training backend as the launcher finds it by name (module docstring)."""

    name: str
    options_type: type[OptionsT]
    """Its settings: an attrs class with flag metadata (:func:`rlcore.config.option`)."""
    runtime: Callable[[OptionsT], RankRuntime]
    """The rank runtime for these options."""
    model_problems: Callable[[Mapping[str, Any], str], list[ConfigProblem]]
    """What in a model folder's ``config.json`` (given as a mapping, and where it was read
    from) this backend cannot build: one problem per field, its ``path`` the field's name in the
    file. Called before anything starts, so it imports no framework."""
    saved_model_problem: Callable[[Path, Mapping[str, Any], str], str | None]
    """Why the weights a stack of this backend saved in a checkpoint folder (``.../actor``) do
    not fit the model a ``config.json`` (a mapping, and where it was read from) describes, or
    ``None`` when they do (or when the backend records nothing to compare)."""
    parallel_problem: Callable[[ParallelSpec], str | None]
    """Why this backend cannot split a model as ``ParallelSpec`` says (a dimension it does not
    implement), or ``None``."""
    install: str = "rlcore"
    """What to ``pip install`` when its packages are missing."""
    options_model_problems: Callable[[OptionsT, Mapping[str, Any]], list[ConfigProblem]] | None = (
        None
    )
    """What in its options the model a ``config.json`` (a mapping) describes cannot take (say
    more recomputed layers than it has), each named with its flag; called before anything
    starts, only for a ``config.json`` that :attr:`model_problems` accepts. ``None``: nothing."""
    model_owner: Callable[[OptionsT, EvalSpec], Role | None] | None = None
    """Whether the eval stack of an :class:`~rlcore.specs.EvalSpec` is a view of the model of
    the training stack of another role rather than a model of its own (with LoRA, the reference
    is the actor's base with the adapters disabled): that role, or ``None``. The backend builds
    such a view in the process that holds that training stack, built before it, so a launcher
    builds the eval stack in that stack's ranks and reserves nothing for it (:meth:`owner_of`).
    ``None`` (the hook): every stack is a model of its own."""

    def owner_of(self, options: object | None, spec: EvalSpec) -> Role | None:
        """The role of the training stack whose model the eval stack of ``spec`` views, with
        ``options`` (the backend's defaults for ``None``); ``None``: a model of its own."""
        if self.model_owner is None:
            return None
        return self.model_owner(self.options(options), spec)

    def options(self, options: object | None) -> OptionsT:
        """``options`` as this backend's options type (its defaults for ``None``)."""
        return kind_options(self.options_type, options, f"backend {self.name!r}")

    def rank_runtime(self, options: object | None) -> RankRuntime:
        """The rank runtime for ``options`` (the backend's defaults for ``None``)."""
        return self.runtime(self.options(options))


KNOWN_BACKENDS: Registry = {
    # name: (module, attribute holding its BackendKind, pip extra)
    "megatron": ("rlcore_megatron.kind", "MEGATRON", "rlcore[megatron]"),
    "fsdp": ("rlcore_fsdp.kind", "FSDP", "rlcore[fsdp]"),
}


def load_backend_kind(name: str) -> BackendKind[Any]:
    """The backend kind registered as ``name``; a clear install hint when its package is
    missing."""
    kind: BackendKind[Any] = load_registered(KNOWN_BACKENDS, name, "backend")
    return kind


def load_backend(name: str, options: object | None = None) -> Backend:
    """The backend registered as ``name``, for this process as one rank (``rlcore.run`` with
    components of your own; a launch runs it on its ranks instead): its kind's rank runtime with
    ``options`` (the backend's defaults for ``None``) builds it. A clear install hint when its
    package is missing."""
    return load_backend_kind(name).rank_runtime(options).backend()
