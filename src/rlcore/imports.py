"""Loading what is named, not imported: a user's function from a ``--...-path`` flag (rollout
function, filter, IS weights), and a backend's or rollout engine's kind from its registry
(:func:`load_registered`).

Two spellings are accepted: ``module:function`` (``pkg.mod:Class.method`` for a dotted attribute)
and slime's ``pkg.mod.function`` (the last dot splits module and attribute). Every failure is a
:class:`~rlcore.errors.ConfigError` naming the flag, the path and what to do, raised when the run
starts rather than when the function is first needed.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, TypeVar, final

import attrs

from rlcore.errors import BackendUnavailableError, ConfigError, ConfigProblem

__all__ = ["NoOptions", "Registry", "kind_options", "load_function", "load_registered"]

OptionsT = TypeVar("OptionsT")

Registry = dict[str, tuple[str, str, str]]
"""Kinds by name: ``name -> (module, attribute holding the kind, pip extra)``. The module named
stays light (no torch, no framework), so that listing a kind's options needs only rlcore."""


@final
@attrs.frozen
class NoOptions:
    """The options of a backend or rollout engine kind that has none."""


def kind_options(options_type: type[OptionsT], options: object | None, kind: str) -> OptionsT:
    """``options`` as a kind's ``options_type`` (its defaults for ``None``); a ``TypeError``
    naming the kind (``"backend 'megatron'"``) for options of another type."""
    if options is None:
        return options_type()
    if not isinstance(options, options_type):
        raise TypeError(f"{kind} takes {options_type.__name__}, got {type(options).__name__}")
    return options


def load_registered(registry: Registry, name: str, what: str) -> Any:
    """The object ``registry`` registers as ``name`` (``what`` says what kind of thing it is in
    messages: ``"backend"``, ``"rollout engine"``). An unknown name lists the known ones; a
    package that is not installed is a :class:`~rlcore.errors.BackendUnavailableError` with the
    command that installs it. The result is typed ``Any``: each registry's caller types it."""
    try:
        module_name, attribute, extra = registry[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown {what} {name!r}; known: {', '.join(sorted(registry))}"
        ) from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{what} {name!r} needs packages that are not installed ({exc.name}): "
            f"pip install '{extra}'"
        ) from exc
    return getattr(module, attribute)


def _split(path: str) -> tuple[str, str]:
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    return module_name, attr_path


def load_function(path: str, *, field: str, arity: int, signature: str) -> Any:
    """The callable ``path`` names, checked to accept ``arity`` positional arguments.

    ``field`` is the config field and flag for the error message (``rollout.rollout_function_path
    (--rollout-function-path)``), ``signature`` the expected signature, shown when it does not fit.
    The result is typed ``Any``: only its callability and arity are checked here.
    """

    def problem(message: str, hint: str) -> ConfigError:
        return ConfigError([ConfigProblem(field, f"{path!r}: {message}", hint)])

    module_name, attr_path = _split(path)
    if not module_name or not attr_path:
        raise problem("expected 'module:function'", "for example my_project.rollouts:generate")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise problem(
            f"cannot import module {module_name!r} ({exc})",
            "check the spelling and that the module is on PYTHONPATH",
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise problem(
                f"module {module_name!r} has no attribute {attr_path!r}",
                "check the name after the module",
            ) from exc
    if not callable(obj):
        raise problem(
            f"{attr_path} is not a function (it is of type {type(obj).__name__})", "point at one"
        )
    try:
        inspect.signature(obj).bind(*([None] * arity))
    except TypeError as exc:
        raise problem(
            f"{attr_path} cannot be called with {arity} argument(s) ({exc})",
            f"give it the signature {signature}",
        ) from exc
    except ValueError:
        pass  # no introspectable signature (some builtins): trust it
    return obj
