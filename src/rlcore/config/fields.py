"""How a config field is declared (:func:`option`: its flag and help text) and how a broken
invariant is reported (:func:`problem`: a :class:`~rlcore.errors.ConfigProblem` naming the field
and its flag).

Engine packages declare their options with :func:`option` too (see :mod:`rlcore.engines`).
"""

from __future__ import annotations

from typing import Any, TypeVar

import attrs

from rlcore.errors import ConfigProblem

__all__ = ["flag_of", "option", "problem", "problems_under"]

_T = TypeVar("_T")


def option(default: _T, flag: str, help: str, **metadata: Any) -> _T:
    """An attrs field with its command-line flag and help text in the metadata (``repeat=True``:
    a repeatable flag; ``invert=True``: a flag that sets a bool to False; ``pairs=True``: a flag
    taking NAME PATH pairs; ``choices``: the values ``--help`` shows)."""
    result: _T = attrs.field(default=default, metadata={"flag": flag, "help": help, **metadata})
    return result


def flag_of(section: type[Any], name: str) -> str:
    """The flag of field ``name`` of the config class ``section`` (its name when it has none)."""
    meta = attrs.fields_dict(section)[name].metadata
    return str(meta.get("flag", name))


def problem(
    section: type[Any], prefix: str, name: str, message: str, hint: str = ""
) -> ConfigProblem:
    """A problem with field ``name`` of ``section``, found at path ``prefix.name`` of the run
    config, named with its flag: ``optim.lr (--lr): must be > 0, got 0.0``."""
    path = f"{prefix}.{name}" if prefix else name
    return ConfigProblem(path=f"{path} ({flag_of(section, name)})", message=message, hint=hint)


def problems_under(problems: list[ConfigProblem], prefix: str) -> bool:
    """Whether any of ``problems`` is about a field under ``prefix`` (``"cluster."``)."""
    return any(p.path.startswith(prefix) for p in problems)
