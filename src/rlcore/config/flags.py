"""Command-line flags and TOML files -> :class:`~rlcore.config.RunConfig`.

The parser is generated from the config classes' field metadata, one argument group per section,
so a flag cannot exist without a field (or the other way round). Values are handed to the cattrs
converter as given, so a bad value is reported like a bad TOML value: with its field path.

Each rollout engine and training backend with options of its own (:mod:`rlcore.config.kinds`)
gets a group and a TOML section under its name (``[sglang]``, ``[megatron]``); its values become
the config's ``engine_options`` or ``backend_options`` when it is the chosen one, and are refused
when it is not.
"""

from __future__ import annotations

import argparse
import difflib
import re
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError

from rlcore.config.convert import converter, problems_from, structure_config, with_flag
from rlcore.config.fields import root_problems
from rlcore.config.kinds import CHOICES, KindChoice
from rlcore.config.run_config import RunConfig
from rlcore.config.saved import (
    EVAL_ONLY_SETTINGS,
    describe,
    read_saved_settings,
    with_saved_settings,
)
from rlcore.errors import ConfigError, ConfigProblem

__all__ = ["build_parser", "load_config", "read_settings", "read_toml"]

USAGE = "%(prog)s [--config FILE.toml] [--FLAG VALUE ...]"

_SECTIONS: dict[str, str] = {
    "rollout": "rollout",
    "algorithm": "algorithm (advantages, loss, KL)",
    "optim": "optimizer and LR schedule",
    "train": "training batches",
    "model": "model and parallelism",
    "cluster": "placement on nodes and GPUs",
    "data": "data and reward",
    "eval": "evaluation",
    "checkpoint": "checkpoints",
    "debug": "debug (saving and replaying rollouts)",
    "multiturn": "multi-turn and tools",
    "opd": "on-policy distillation",
}


_Flagged = tuple[str | None, type[Any], "attrs.Attribute[Any]"]


def _kind_sections() -> dict[str, tuple[KindChoice, type[Any]]]:
    """Section name -> (the choice it belongs to, its options class), for every installed engine
    and backend whose options have flags."""
    return {
        name: (choice, options_type)
        for choice in CHOICES
        for name, options_type in choice.options_types().items()
    }


def _fields_with_flags() -> list[_Flagged]:
    """(section or None for top-level, its class, field) for every field that has a flag: the
    run config's sections, then each engine's options."""
    out: list[_Flagged] = []
    hints = typing.get_type_hints(RunConfig)
    for field in attrs.fields(RunConfig):
        section_type = hints[field.name]
        if attrs.has(section_type):
            out += [
                (field.name, section_type, f)
                for f in attrs.fields(section_type)
                if "flag" in f.metadata
            ]
        elif "flag" in field.metadata:
            out.append((None, RunConfig, field))
    for name, (_, options_type) in _kind_sections().items():
        out += [(name, options_type, f) for f in attrs.fields(options_type) if "flag" in f.metadata]
    return out


def _is_bool(field: attrs.Attribute[Any], owner: type[Any]) -> bool:
    return typing.get_type_hints(owner)[field.name] is bool


def _choices(field: attrs.Attribute[Any], owner: type[Any]) -> tuple[str, ...] | None:
    if "choices" in field.metadata:
        return tuple(field.metadata["choices"])
    hint = typing.get_type_hints(owner)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(hint))
    if (
        isinstance(hint, types.UnionType)
        and len(args) == 1
        and typing.get_origin(args[0]) is typing.Literal
    ):
        return tuple(str(a) for a in typing.get_args(args[0]))
    return None


class _Parser(argparse.ArgumentParser):
    """argparse that raises :class:`ConfigError` instead of exiting, so all errors look alike."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError([ConfigProblem("flags", message, "see --help")], "flags")


def build_parser(
    prog: str = "python -m rlcore_megatron.run", description: str = ""
) -> argparse.ArgumentParser:
    """The CLI parser: ``--config FILE`` plus one flag per config field, grouped by section.

    Defaults are suppressed so only the flags actually given override the file.
    """
    parser = _Parser(
        prog=prog,
        # argparse's generated usage lists every flag (60 lines); the groups below describe them.
        usage=USAGE,
        description=description,
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE.toml",
        help="TOML file with the run's settings (sections as in [brackets] below); flags "
        "override it",
    )
    groups: dict[str | None, argparse._ArgumentGroup] = {
        None: parser.add_argument_group("run (top level of the TOML file)")
    }
    for name, title in _SECTIONS.items():
        groups[name] = parser.add_argument_group(f"{title} [{name}]")
    for name, (choice, _) in _kind_sections().items():
        groups[name] = parser.add_argument_group(
            f"{choice.what} {name} (with {choice.flag} {name}) [{name}]"
        )
    for section, owner, field in _fields_with_flags():
        meta = field.metadata
        dest = f"{section}.{field.name}" if section else field.name
        default = field.default
        shown = (
            f" (default: {default})"
            if default not in (None, (), attrs.NOTHING) and not _is_bool(field, owner)
            else ""
        )
        kwargs: dict[str, Any] = {"dest": dest, "help": meta["help"] + shown}
        if _is_bool(field, owner):
            kwargs["action"] = "store_false" if meta.get("invert") else "store_true"
        elif meta.get("pairs"):
            kwargs.update(nargs="+", metavar="NAME PATH")
        elif meta.get("repeat"):
            kwargs.update(action="append", metavar="VALUE")
        else:
            # Choices are shown, not enforced here: the converter reports a bad value with its path.
            choices = _choices(field, owner)
            kwargs["metavar"] = (
                field.name.upper() if choices is None else "{" + ",".join(choices) + "}"
            )
        groups[section].add_argument(meta["flag"], **kwargs)
    return parser


def read_toml(path: Path) -> dict[str, Any]:
    """A TOML config file as nested data; a syntax error names the file, line and column."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([ConfigProblem("--config", f"file not found: {path}")]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            [ConfigProblem("--config", f"{path}: {exc}", "fix the TOML syntax")], str(path)
        ) from exc


def _overrides(namespace: argparse.Namespace) -> tuple[dict[str, Any], list[ConfigProblem]]:
    data: dict[str, Any] = {}
    problems: list[ConfigProblem] = []
    for dest, value in vars(namespace).items():
        if dest == "config":
            continue
        if dest == "eval.prompt_data":
            if len(value) % 2:
                problems.append(
                    ConfigProblem(
                        "eval.prompt_data (--eval-prompt-data)",
                        f"expects NAME PATH pairs, got {len(value)} value"
                        f"{'' if len(value) == 1 else 's'}: {value}",
                        "give a name before every path",
                    )
                )
                continue
            value = [{"name": n, "path": p} for n, p in zip(value[::2], value[1::2], strict=True)]
        section, _, name = dest.rpartition(".")
        target = data.setdefault(section, {}) if section else data
        target[name] = value
    return data, problems


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    argv: Sequence[str],
    parser: argparse.ArgumentParser | None = None,
    *,
    report: list[str] | None = None,
) -> RunConfig:
    """Flags (and the ``--config`` file they name) -> a valid :class:`RunConfig`.

    An eval-only run (``--num-rollout 0``) with ``--load`` takes the settings of
    :data:`~rlcore.config.saved.EVAL_ONLY_SETTINGS` (the model folder, response lengths,
    sampling, how prompts are read, the reward, the environment) from the checkpoint's run where
    the flags and the file do not give them; ``report``, when given, receives one line for each
    setting the checkpoint decided or a flag overrode.

    Raises :class:`ConfigError` listing every problem: unknown flags (with a suggestion), values of
    the wrong type, unknown TOML keys, broken invariants, prompt files that do not exist
    (``--prompt-data``, ``--eval-prompt-data``: a path is checked here, its contents when the
    data is read), an eval-only ``--load`` that names no checkpoint.
    """
    data, source, problems = _read(argv, parser or build_parser())
    config = _build(data, source, problems)
    if config.is_eval_only and config.checkpoint.load is not None:
        folder, saved = read_saved_settings(config.checkpoint.load)
        if saved:
            config = _build(with_saved_settings(data, saved, EVAL_ONLY_SETTINGS), source, problems)
            if report is not None:
                lines = describe(data, saved, config, EVAL_ONLY_SETTINGS)
                report += [f"eval-only run of {folder}: {line}" for line in lines]
    return config


def read_settings(
    argv: Sequence[str], parser: argparse.ArgumentParser | None = None
) -> dict[str, Any]:
    """What the flags (and the ``--config`` file they name) set, as plain data by section, before
    anything is checked: for a caller that wants to look at some settings of a config that
    :func:`load_config` refuses. Raises :class:`ConfigError` only when the file cannot be read."""
    return _read(argv, parser or build_parser())[0]


def _read(
    argv: Sequence[str], parser: argparse.ArgumentParser
) -> tuple[dict[str, Any], str, list[ConfigProblem]]:
    """The settings by section, where they come from, and the flags' own problems."""
    namespace, unknown = parser.parse_known_args(_negative_values_joined(argv, parser))
    problems = _unknown_flag_problems(unknown, parser)
    overrides, pair_problems = _overrides(namespace)
    problems += pair_problems
    config_path: Path | None = getattr(namespace, "config", None)
    base = read_toml(config_path) if config_path is not None else {}
    source = str(config_path) if config_path is not None else "flags"
    return _merge(base, overrides), source, problems


def _build(data: dict[str, Any], source: str, problems: list[ConfigProblem]) -> RunConfig:
    """The config ``data`` (sections, and engine sections) describes, or :class:`ConfigError`
    with ``problems`` and every new one."""
    data = dict(data)
    sections = [
        {name: data.pop(name) for name in choice.registry if name in data} for choice in CHOICES
    ]
    try:
        config = structure_config(data, source)
    except ConfigError as exc:
        # The flags' own problems are causes: what the config derives from them is left out.
        raise ConfigError(root_problems(problems + list(exc.problems)), source) from exc.__cause__
    for choice, given in zip(CHOICES, sections, strict=True):
        chosen = choice.chosen(config)
        problems = problems + [
            ConfigProblem(
                f"{name}",
                f"settings of the {name!r} {choice.what}, but the {choice.what} is {chosen!r}",
                f"add {choice.flag} {name}, or drop them",
            )
            for name in given
            if name != chosen
        ]
    problems += missing_data_files(config)
    if problems:
        raise ConfigError(problems, source)
    for choice, given in zip(CHOICES, sections, strict=True):
        config = _with_options(choice, config, given.get(choice.chosen(config), {}), source)
    return config


def missing_data_files(config: RunConfig) -> list[ConfigProblem]:
    """A problem for each prompt file the config names that is not a file."""
    files = [(with_flag("data.prompt_data"), config.data.prompt_data)]
    files += [(with_flag("eval.prompt_data"), entry.path) for entry in config.eval.prompt_data]
    return [
        ConfigProblem(
            where,
            f"{path} does not exist" if not path.exists() else f"{path} is not a file",
            "check the path; a relative path is read from the current folder",
        )
        for where, path in files
        if path is not None and not path.is_file()
    ]


def _with_options(
    choice: KindChoice, config: RunConfig, data: dict[str, Any], source: str
) -> RunConfig:
    """``config`` with the chosen engine's or backend's options built from ``data`` (its
    section)."""
    name = choice.chosen(config)
    options_type = choice.load(name).options_type  # the config check has imported it already
    try:
        options = converter.structure(data, options_type)
    except ConfigError as exc:
        raise ConfigError(exc.problems, source) from None
    except (ClassValidationError, ForbiddenExtraKeysError) as exc:
        raise ConfigError(problems_from(exc, name, options_type), source) from exc
    with_options: RunConfig = choice.with_options(config, options)
    return with_options


_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-inf(inity)?", re.IGNORECASE)


def _negative_values_joined(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with every negative number after a flag that takes one value joined to it
    (``--lr -1e-6`` -> ``--lr=-1e-6``): argparse reads ``-1e-6`` as a flag of its own and then
    reports the real flag's value as missing, hiding the message about the value itself."""
    takes_one = {o for a in parser._actions if a.nargs is None for o in a.option_strings}
    out: list[str] = []
    for token in argv:
        if out and out[-1] in takes_one and _NEGATIVE_NUMBER.fullmatch(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _unknown_flag_problems(
    unknown: Sequence[str], parser: argparse.ArgumentParser
) -> list[ConfigProblem]:
    """One problem per unknown flag, with the closest known flag; the values after it are
    skipped."""
    known = [o for a in parser._actions for o in a.option_strings]
    problems: list[ConfigProblem] = []
    after_flag = False
    for token in unknown:
        if token.startswith("-"):
            flag = token.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1)
            problems.append(
                ConfigProblem(
                    flag, "unknown flag", f"did you mean {close[0]}?" if close else "see --help"
                )
            )
            after_flag = True
        elif not after_flag:
            problems.append(ConfigProblem(token, "unexpected argument", "see --help"))
    return problems
