"""A run's saved settings as defaults: an eval-only run of a checkpoint samples, reads its data and
scores as the run that trained it did, unless a flag says otherwise.

Every checkpoint records its run's settings
(:attr:`~rlcore.checkpoint_files.CheckpointMeta.settings`, shaped like a ``--config`` file). For an
eval-only run with ``--load``,
:func:`~rlcore.config.flags.load_config` takes the settings in :data:`EVAL_ONLY_SETTINGS` from
there where neither the flags nor the ``--config`` file give them, and says which it took and
which a flag overrode (:func:`describe`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs

from rlcore.checkpoint_files import find_checkpoint, read_meta
from rlcore.config.convert import with_flag
from rlcore.config.run_config import RunConfig
from rlcore.errors import CheckpointError, ConfigError, ConfigProblem

__all__ = ["EVAL_ONLY_SETTINGS", "describe", "read_saved_settings", "with_saved_settings"]

EVAL_ONLY_SETTINGS: Final = (
    "model.hf_checkpoint",
    "rollout.max_response_len",
    "rollout.top_p",
    "rollout.top_k",
    "eval.max_response_len",
    "eval.temperature",
    "eval.n_samples_per_eval_prompt",
    "data.input_key",
    "data.label_key",
    "data.apply_chat_template",
    "data.rm_type",
    "data.custom_rm_path",
    "multiturn.environment_path",
    "multiturn.custom_generate_function_path",
    "multiturn.max_turns",
    "multiturn.env_reward",
)
"""What an eval-only run takes from the checkpoint it evaluates: the model folder, the response
lengths and sampling, how prompts are read, the reward, the episodes' environment."""


def read_saved_settings(load: Path) -> tuple[Path, Mapping[str, Any]]:
    """The checkpoint folder ``--load`` names and the settings its run recorded (empty for a
    checkpoint that recorded none). Raises :class:`ConfigError` naming ``--load`` when there is no
    readable checkpoint there."""
    try:
        folder = find_checkpoint(load)
        return folder, read_meta(folder).settings
    except CheckpointError as exc:
        raise ConfigError([ConfigProblem(with_flag("checkpoint.load"), str(exc))]) from exc


def _get(data: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    section, _, name = path.rpartition(".")
    table = data.get(section, {}) if section else data
    if isinstance(table, Mapping) and name in table:
        return True, table[name]
    return False, None


def with_saved_settings(
    data: Mapping[str, Any], saved: Mapping[str, Any], paths: tuple[str, ...]
) -> dict[str, Any]:
    """``data`` (the flags over the ``--config`` file) with each setting of ``paths`` that it does
    not give taken from ``saved``."""
    out = {key: dict(value) if isinstance(value, Mapping) else value for key, value in data.items()}
    for path in paths:
        given, _ = _get(data, path)
        found, value = _get(saved, path)
        if found and not given:
            section, _, name = path.rpartition(".")
            out.setdefault(section, {})[name] = value
    return out


def _value(config: RunConfig, path: str) -> Any:
    section, _, name = path.rpartition(".")
    return getattr(getattr(config, section), name)


def describe(
    given: Mapping[str, Any],
    saved: Mapping[str, Any],
    config: RunConfig,
    paths: tuple[str, ...],
) -> list[str]:
    """One line per setting of ``paths`` where the checkpoint mattered: taken from it (and not
    the default), or given by a flag or the ``--config`` file that differs from it."""
    lines = []
    for path in paths:
        found, value = _get(saved, path)
        if not found:
            continue
        final = _value(config, path)
        shown = str(final) if isinstance(final, Path) else repr(final)
        if _get(given, path)[0]:
            if _same(final, value):
                continue
            lines.append(
                f"{with_flag(path)} = {shown}: given, where the checkpoint's run had {value!r}"
            )
        elif not _same(final, _default(config, path)):
            lines.append(f"{with_flag(path)} = {shown}: from the checkpoint")
    return lines


def _default(config: RunConfig, path: str) -> Any:
    section, _, name = path.rpartition(".")
    return attrs.fields_dict(type(getattr(config, section)))[name].default


def _same(a: Any, b: Any) -> bool:
    return (str(a) if isinstance(a, Path) else a) == (str(b) if isinstance(b, Path) else b)
