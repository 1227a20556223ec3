"""The one converter for configs (cattrs, strict scalars, unknown keys refused) and how its
errors become :class:`~rlcore.errors.ConfigProblem` s that name the field path and its flag.
"""

from __future__ import annotations

import difflib
import math
import typing
from pathlib import Path
from typing import Any, Final

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from rlcore.config.kinds import CHOICES
from rlcore.config.run_config import RunConfig
from rlcore.errors import ConfigError, ConfigProblem
from rlcore.specs import LossAggMode

__all__ = ["converter", "problems_from", "settings_data", "structure_config", "with_flag"]


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(Path, lambda v, _: _structure_path(v))
    conv.register_structure_hook(int, lambda v, _: _structure_int(v))
    conv.register_structure_hook(float, lambda v, _: _structure_float(v))
    conv.register_structure_hook(bool, lambda v, _: _structure_bool(v))
    conv.register_structure_hook_func(lambda t: t is object, _structure_kind_options)
    conv.register_structure_hook_func(lambda t: t == LossAggMode, _structure_agg_mode)
    return conv


VERL_DR_GRPO_MODE: Final = "seq-mean-token-sum-norm"
"""verl's name for a loss aggregation whose number rlcore does not give: rlcore's Dr. GRPO
normaliser (``seq-mean-token-sum-budget``) was called this before #34, and checkpoints written
then record it (:func:`rlcore.config.resume.saved_config` reads it as the new name)."""


def _structure_agg_mode(value: object, _: object) -> str:
    """``--loss-agg-mode``: one of :data:`~rlcore.specs.LossAggMode`, and verl's Dr. GRPO name
    refused with what to use instead."""
    if value == VERL_DR_GRPO_MODE:
        raise ConfigError(
            [
                ConfigProblem(
                    with_flag("algorithm.loss_agg_mode"),
                    f"{VERL_DR_GRPO_MODE} is verl's name for each sequence's token sum over a "
                    "constant, summed over a micro-batch's sequences without dividing by their "
                    "count (a number that moves with the micro-batch and data-parallel sizes); "
                    "rlcore's Dr. GRPO normaliser averages over the global batch's sequences",
                    "use seq-mean-token-sum-budget, the number rlcore gave under this name before",
                )
            ]
        )
    modes = typing.get_args(LossAggMode)
    if isinstance(value, str) and value in modes:
        return value
    raise ValueError(f"{value!r} is not one of {', '.join(modes)}")


class _NotFinite(ValueError):
    """A NaN or infinite float value (reported without the "invalid value" prefix)."""


def _structure_kind_options(value: object, _: object) -> object:
    raise TypeError(
        "an engine's or backend's settings go in its own section ([sglang] for "
        "--rollout-engine sglang, [megatron] for --train-backend megatron)"
    )


# Strict scalars: cattrs' defaults call int()/bool() and would turn 3.7 into 3 and "no" into True.
def _structure_path(value: object) -> Path:
    if isinstance(value, (str, Path)):
        return Path(value)
    raise TypeError(f"expected a path string, got {type(value).__name__}")


def _structure_int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise TypeError(f"expected an integer, got {value!r}")


def _structure_float(value: object) -> float:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise TypeError(f"expected a number, got {value!r}")
    if not math.isfinite(number):
        # Refused here, so the field itself is named and no invariant sees it.
        raise _NotFinite(f"must be a finite number, got {value}")
    return number


def _structure_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"expected true or false, got {value!r}")


converter = _make_converter()
"""The one converter for configs: unknown keys are errors, all errors are collected."""


def _did_you_mean(key: str, cls: type[Any]) -> str:
    names = [f.name for f in attrs.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(names)}"


def problems_from(exc: BaseException, path: str, cls: type[Any] | None) -> list[ConfigProblem]:
    if isinstance(exc, ForbiddenExtraKeysError):
        return [
            ConfigProblem(
                path=f"{path}.{key}" if path else key,
                message="unknown key",
                hint=_did_you_mean(key, exc.cl),
            )
            for key in sorted(exc.extra_fields)
        ]
    if isinstance(exc, ClassValidationError):
        out: list[ConfigProblem] = []
        noted, bare = exc.group_exceptions()
        for sub, note in noted:
            sub_path = f"{path}.{note.name}" if path else note.name
            out += problems_from(sub, sub_path, exc.cl)
        for sub in bare:
            out += problems_from(sub, path, exc.cl)
        return out
    if isinstance(exc, IterableValidationError):
        out = []
        inoted, ibare = exc.group_exceptions()
        for sub, inote in inoted:
            out += problems_from(sub, f"{path}[{inote.index}]", None)
        for sub in ibare:
            out += problems_from(sub, path, None)
        return out
    if isinstance(exc, ConfigError):
        return list(exc.problems)
    if isinstance(exc, _NotFinite):
        return [ConfigProblem(path=with_flag(path) or "<root>", message=str(exc))]
    del cls
    return [ConfigProblem(path=with_flag(path) or "<root>", message=f"invalid value: {exc}")]


def with_flag(path: str) -> str:
    """``rollout.num_rollout`` -> ``rollout.num_rollout (--num-rollout)`` when the field has a
    flag."""
    owner: type[Any] = RunConfig
    meta: Any = {}
    for part in path.split("."):
        fields = attrs.fields_dict(owner) if attrs.has(owner) else {}
        if part not in fields:
            return path
        meta = fields[part].metadata
        field_type = fields[part].type
        owner = field_type if isinstance(field_type, type) else object
    return f"{path} ({meta['flag']})" if "flag" in meta else path


def structure_config(data: dict[str, Any], source: str = "") -> RunConfig:
    """Build a :class:`RunConfig` from nested plain data (a parsed TOML file, flags merged in).

    Raises :class:`ConfigError` listing every problem: unknown keys (with a suggestion), values of
    the wrong type, and every broken invariant.
    """
    try:
        return converter.structure(data, RunConfig)
    except ConfigError as exc:
        raise ConfigError(exc.problems, source) from None
    except (ClassValidationError, ForbiddenExtraKeysError) as exc:
        raise ConfigError(problems_from(exc, "", RunConfig), source) from exc


def settings_data(config: RunConfig) -> dict[str, Any]:
    """``config`` as plain data shaped like a ``--config`` TOML file: its sections, and the
    chosen engine's and backend's options each as a section named after it (``[sglang]``).
    Paths are strings, unset values ``None``. :func:`structure_config` (with those sections taken
    apart again, as :func:`rlcore.config.flags.load_config` does) reads it back."""
    data: dict[str, Any] = converter.unstructure(config)
    for choice in CHOICES:
        options = data[choice.section].pop(choice.options_field)
        if options is not None:
            data[data[choice.section][choice.field]] = converter.unstructure(options)
    return data
