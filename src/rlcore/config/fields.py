"""How a config field is declared (:func:`option`: its flag and help text) and how a broken
invariant is reported (:func:`problem`: a :class:`~rlcore.errors.ConfigProblem` naming the field
and its flag).

Engine packages declare their options with :func:`option` too (see :mod:`rlcore.engines`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import attrs

from rlcore.errors import ConfigProblem

__all__ = ["flag_of", "option", "problem", "problems_under", "root_problems"]

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
    section: type[Any],
    prefix: str,
    name: str,
    message: str,
    hint: str = "",
    *,
    reads: Sequence[str] = (),
) -> ConfigProblem:
    """A problem with field ``name`` of ``section``, found at path ``prefix.name`` of the run
    config, named with its flag: ``optim.lr (--lr): must be > 0, got 0.0``. ``reads``: the
    other fields (paths) the broken rule read, when it is derived from them."""
    path = f"{prefix}.{name}" if prefix else name
    flagged = f"{path} ({flag_of(section, name)})"
    return ConfigProblem(flagged, message, hint, reads=tuple(reads))


def root_problems(problems: Sequence[ConfigProblem]) -> list[ConfigProblem]:
    """``problems`` less those derived from a setting that is reported wrong itself: a problem
    that :attr:`~rlcore.errors.ConfigProblem.reads` a field with a problem that is kept is left
    out (``--num-rollout -1`` is reported once, not again as the bound of
    ``--sft-warmup-rollouts``), and so is a derived problem of a field whose own range check
    failed (``--n-samples-per-prompt 0`` is not also too few for GRPO). A problem that reads
    nothing else is always kept."""
    by_field: dict[str, list[int]] = {}
    for i, p in enumerate(problems):
        by_field.setdefault(p.field, []).append(i)
    kept: dict[int, bool] = {}

    def keep(i: int, seen: frozenset[int]) -> bool:
        if i not in kept:
            p = problems[i]
            causes = [j for f in p.reads if f != p.field for j in by_field.get(f, ())]
            if p.reads:  # the field's own problems that read nothing else come first
                causes += [j for j in by_field[p.field] if not problems[j].reads]
            kept[i] = not any(keep(j, seen | {i}) for j in causes if j not in seen)
        return kept[i]

    return [p for i, p in enumerate(problems) if keep(i, frozenset({i}))]


def problems_under(problems: list[ConfigProblem], prefix: str) -> bool:
    """Whether any of ``problems`` is about a field under ``prefix`` (``"cluster."``)."""
    return any(p.path.startswith(prefix) for p in problems)
