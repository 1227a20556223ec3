"""Checkpoint folders as files: their layout, the core's record in each, finding the one that
``--load`` means, and the record each stack writes in its own folder. The loop writes
checkpoints (:mod:`rlcore.loop.checkpoints`); the loop, the config (a run's saved settings) and a
CLI's checks before start-up read them.

Layout under the ``--save`` folder::

    rollout_000003/          one folder per saved rollout, named by its number (the count of
                             rollouts done: the third rollout's; :func:`rollout_number`)
        actor/  critic/      written by each training stack's ``save``
        manifest.json        every other file's size and a checksum of its first and last MiB
        rlcore.json          rollout id, dataset position, stacks saved, the run's settings
                             (written last: a folder without it is not a checkpoint)
    latest                   text file naming the newest complete rollout folder

:func:`verify_checkpoint` checks a folder against its manifest (a missing, cut or overwritten
file is named), in time proportional to the number of files, not their size: a run checks what
``--load`` names before anything starts.
"""

from __future__ import annotations

import json
import string
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rlcore.errors import CheckpointError

__all__ = [
    "INTERRUPTED_SAVES",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "META_FILE",
    "STACK_RECORD_FILE",
    "CheckpointMeta",
    "check_record_matches",
    "complete_checkpoints",
    "find_checkpoint",
    "find_checkpoint_of",
    "newest_intact_checkpoint",
    "recorded_model_folder",
    "read_meta",
    "read_stack_record",
    "rollout_dir_name",
    "rollout_number",
    "rollout_path",
    "saved_checkpoints",
    "template_problem",
    "write_stack_record",
]

META_FILE = "rlcore.json"
LATEST_FILE = "latest"
INTERRUPTED_SAVES = (".tmp-rollout_*", ".old-rollout_*", f".{LATEST_FILE}.tmp")
"""What an interrupted save can leave in the save folder: the temporary folder of the checkpoint
it was writing, the previous folder of a re-save, the new ``latest`` pointer."""
MANIFEST_FILE = "manifest.json"
_ENDS = 2**20
"""Bytes at each end of a file that its checksum covers."""


@attrs.frozen
class CheckpointMeta:
    """What the core records beside the stacks' own state."""

    rollout_id: int
    """The id of the rollout saved, counted from 0 as the loop does (its number is
    :func:`rollout_number` of it); read from here, never from the folder's name, so that a folder
    named by the id (before rollouts were numbered by count) resumes where it stopped."""
    consumed_prompts: int
    stacks: tuple[str, ...]
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    """The run's configuration as plain data, shaped like a ``--config`` TOML file (sections,
    and the chosen engine's own section): what a resumed or eval-only run compares with or takes
    its defaults from. Empty in checkpoints written before it was recorded."""


def rollout_number(rollout_id: int) -> int:
    """The number a rollout goes by wherever a person sees it (checkpoint and export folders,
    saved rollout files, metrics steps, logs, ``summary.json``, flags): the count of rollouts
    done once it is trained, so rollout id 0 (the first) is rollout 1, the checkpoint after 80
    rollouts is ``rollout_000080``, and ``-1`` (before training) is 0. The loop, the rollout
    seam (:attr:`~rlcore.protocols.rollout.RolloutContext.rollout_id`) and
    :class:`~rlcore.loop.RunResult` count ids from 0, as slime does."""
    return rollout_id + 1


def rollout_dir_name(number: int) -> str:
    """The folder of rollout ``number`` (:func:`rollout_number`): ``rollout_NNNNNN``."""
    return f"rollout_{number:06d}"


def template_problem(path: str) -> str | None:
    """Why ``path``, given where a run writes or reads one file or folder per rollout
    (``--save-hf``, ``--save-debug-rollout-data``, ``--load-debug-rollout-data``), is neither a
    plain path (no braces) nor a path template the way slime's are: ``str.format`` with the one
    field ``{rollout_id}`` (a format spec such as ``{rollout_id:06d}`` allowed, a literal brace
    doubled); ``None`` when it is one of them."""
    if "{" not in path and "}" not in path:
        return None
    try:
        fields = {field for _, field, _, _ in string.Formatter().parse(path) if field is not None}
    except ValueError as exc:
        return f"{path!r} has a brace that is not part of a field ({exc}; a literal one is doubled)"
    other = sorted(fields - {"rollout_id"})
    if other:
        named = ", ".join(f"{{{field}}}" for field in other)
        return f"{path!r} has {named}: the one field a path template takes is {{rollout_id}}"
    if not fields:
        return f"{path!r} has braces but no {{rollout_id}} field"
    try:
        path.format(rollout_id=0)
    except ValueError as exc:
        return f"{path!r} cannot format a rollout's number: {exc}"
    return None


def rollout_path(template: str, rollout_id: int, suffix: str = "") -> Path:
    """Where rollout id ``rollout_id``'s file or folder goes under ``template``: with a
    ``{rollout_id}`` field, ``template.format(rollout_id=N)`` (slime's convention), ``N`` the
    rollout's number (:func:`rollout_number`); without braces, the folder ``template`` holding
    ``rollout_NNNNNN`` + ``suffix``. The config refuses any other path
    (:func:`template_problem`)."""
    number = rollout_number(rollout_id)
    if "{" in template or "}" in template:
        return Path(template.format(rollout_id=number))
    return Path(template) / f"{rollout_dir_name(number)}{suffix}"


def find_checkpoint(path: Path) -> Path:
    """The rollout folder that ``--load PATH`` means: PATH itself when it holds ``rlcore.json``,
    else the folder named by ``PATH/latest``. Raises :class:`CheckpointError` naming the path."""
    if (path / META_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist; check --load")
    if not latest.is_file():
        interrupted = sorted(path.glob(INTERRUPTED_SAVES[0]))
        if interrupted:
            raise CheckpointError(
                f"{path} holds no checkpoint: its only save was interrupted before it was "
                f"complete (it left the temporary folder {interrupted[-1].name}). Start the run "
                f"again without --load: its first save into {path} removes that folder (or "
                "delete it yourself)"
            )
        raise CheckpointError(
            f"{path} is neither a checkpoint (no {META_FILE}) nor a save folder "
            f"(no '{LATEST_FILE}' file); point --load at a folder written by --save"
        )
    target = path / latest.read_text().strip()
    if not (target / META_FILE).is_file():
        raise CheckpointError(f"{latest} names {target}, which is not a complete checkpoint")
    return target


def find_checkpoint_of(path: Path, number: int | None) -> Path:
    """:func:`find_checkpoint`, or with ``number`` the checkpoint of that rollout
    (:func:`rollout_number`) in the save folder ``path`` (slime's ``--ckpt-step``), found by the
    rollout each checkpoint records, whatever its folder is named. Raises
    :class:`CheckpointError` naming the rollouts whose checkpoints the folder holds when it has
    none of ``number``."""
    if number is None:
        return find_checkpoint(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist")
    if (path / META_FILE).is_file():
        raise CheckpointError(
            f"{path} is one checkpoint, not a save folder to pick rollout {number}'s from; "
            f"point at the save folder {path.parent}, or drop the step"
        )
    held = complete_checkpoints(path)
    for folder, held_number in held.items():
        if held_number == number:
            return folder
    numbers = ", ".join(str(n) for n in held.values())
    have = f"checkpoints of rollouts {numbers}" if held else "no complete checkpoint"
    raise CheckpointError(f"{path} has no checkpoint of rollout {number}: it holds {have}")


def complete_checkpoints(save: Path) -> dict[Path, int]:
    """The complete checkpoints in the save folder ``save`` and the number of the rollout each
    records (:func:`rollout_number`), oldest first; a checkpoint whose record is unreadable is
    left out (:func:`read_meta` names it where it is loaded)."""
    found = {}
    for folder in saved_checkpoints(save):
        if folder.is_dir() and (folder / META_FILE).is_file():
            try:
                found[folder] = rollout_number(read_meta(folder).rollout_id)
            except CheckpointError:
                continue
    return dict(sorted(found.items(), key=lambda item: item[1]))


def recorded_model_folder(folder: Path) -> Path:
    """The model folder (``--hf-checkpoint``) the run that wrote the checkpoint ``folder``
    recorded in its settings: the architecture its weights belong to. Raises
    :class:`CheckpointError` when it recorded none (checkpoints older than the recorded
    settings)."""
    model = read_meta(folder).settings.get("model", {})
    found = model.get("hf_checkpoint") if isinstance(model, dict) else None
    if not isinstance(found, str) or not found:
        raise CheckpointError(
            f"{folder / META_FILE} records no model folder (model.hf_checkpoint): the "
            "architecture of its weights is unknown"
        )
    return Path(found)


def saved_checkpoints(save: Path) -> list[Path]:
    """What a save folder holds of earlier saves: its rollout folders (complete or not) and its
    ``latest`` pointer, oldest first; empty for a folder that does not exist."""
    if not save.is_dir():
        return []
    found = sorted(p for p in save.glob("rollout_*") if p.is_dir())
    return [*found, *([save / LATEST_FILE] if (save / LATEST_FILE).exists() else [])]


def read_meta(folder: Path) -> CheckpointMeta:
    """The core's record in a rollout folder; :class:`CheckpointError` names the file if corrupt."""
    path = folder / META_FILE
    try:
        raw = json.loads(path.read_text())
        settings = raw.get("settings", {})
        if not isinstance(settings, dict):
            raise TypeError(f"settings is of type {type(settings).__name__}, not an object")
        return CheckpointMeta(
            rollout_id=int(raw["rollout_id"]),
            consumed_prompts=int(raw["consumed_prompts"]),
            stacks=tuple(str(s) for s in raw["stacks"]),
            settings=settings,
        )
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete checkpoint") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from exc


def _checksum(path: Path, size: int) -> str:
    """CRC-32 of the file's first and last MiB (all of it when it is smaller), as hex."""
    with path.open("rb") as f:
        crc = zlib.crc32(f.read(_ENDS))
        if size > 2 * _ENDS:
            f.seek(size - _ENDS)
        crc = zlib.crc32(f.read(), crc)
    return f"{crc:08x}"


def _files(folder: Path) -> list[Path]:
    skip = {folder / MANIFEST_FILE, folder / META_FILE}
    return sorted(p for p in folder.rglob("*") if p.is_file() and p not in skip)


def write_manifest(folder: Path) -> None:
    """Record every file in the checkpoint folder ``folder`` (but the manifest and
    ``rlcore.json``): its size and :func:`_checksum`."""
    entries = {}
    for path in _files(folder):
        size = path.stat().st_size
        entries[path.relative_to(folder).as_posix()] = {
            "size": size,
            "crc32": _checksum(path, size),
        }
    (folder / MANIFEST_FILE).write_text(json.dumps({"files": entries}, indent=1))


def verify_checkpoint(folder: Path) -> list[str]:
    """What is wrong with the checkpoint ``folder`` against its manifest: each file that is
    missing, has another size or another checksum (a line naming it). Empty when all is well, or
    when the checkpoint predates manifests."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return []
    try:
        entries = {name: (int(e["size"]), str(e["crc32"])) for name, e in _read_files(path)}
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{path} is corrupt ({exc})"]
    problems = []
    for name, (saved_size, crc) in sorted(entries.items()):
        file = folder / name
        if not file.is_file():
            problems.append(f"{file} is missing")
            continue
        size = file.stat().st_size
        if size != saved_size:
            problems.append(f"{file} has {size} bytes, {saved_size} when it was saved")
        elif _checksum(file, size) != crc:
            problems.append(f"{file} has changed since it was saved (its checksum differs)")
    return problems


def _read_files(path: Path) -> list[tuple[str, Any]]:
    files = json.loads(path.read_text())["files"]
    if not isinstance(files, dict):
        raise TypeError(f"'files' is of type {type(files).__name__}, not an object")
    return list(files.items())


def newest_intact_checkpoint(save: Path, *, besides: Path) -> Path | None:
    """The newest complete checkpoint in the save folder ``save``, other than ``besides``, that
    :func:`verify_checkpoint` finds nothing wrong with."""
    for folder in reversed(saved_checkpoints(save)):
        if folder.is_dir() and folder != besides and (folder / META_FILE).is_file():
            if not verify_checkpoint(folder):
                return folder
    return None


STACK_RECORD_FILE = "rollout.json"
"""A stack's own record in its folder (``.../actor/rollout.json``): the rollout id, its format and
what it saved (model, optimizer), written last by every backend's ``save``."""


def write_stack_record(path: Path, record: Mapping[str, Any]) -> None:
    """Write a stack's record (``rollout_id``, ``format``, what the backend compares on load) into
    the stack folder ``path`` atomically: a folder without it is a half-written save."""
    tmp = path / (STACK_RECORD_FILE + ".tmp")
    tmp.write_text(json.dumps(dict(record)))
    tmp.replace(path / STACK_RECORD_FILE)


def read_stack_record(path: Path, format: str) -> dict[str, Any]:
    """The record a stack of the backend whose checkpoints are ``format`` wrote in ``path``;
    :class:`CheckpointError` when the folder is missing, half-written or another format."""
    path = Path(path)
    record_file = path / STACK_RECORD_FILE
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (check --load / the save dir)")
    try:
        record: Any = json.loads(record_file.read_text())
        rollout_id = record["rollout_id"]
        if record.get("format") != format or not isinstance(rollout_id, int):
            raise ValueError(f"unexpected content {record!r}")
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {STACK_RECORD_FILE} is missing (a save was "
            "interrupted); load an earlier checkpoint"
        ) from exc
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {record_file} is corrupt: {exc}") from exc
    return dict(record)


def check_record_matches(
    path: Path, saved: Mapping[str, object], here: Mapping[str, object], holds: str, advice: str
) -> None:
    """Refuse a checkpoint whose recorded ``saved`` differs from ``here`` in any key of ``here``:
    ``checkpoint PATH holds HOLDS: KEY is A there, B here (ADVICE)``."""
    wrong = sorted(k for k in here if saved.get(k) != here[k])
    if wrong:
        raise CheckpointError(
            f"checkpoint {path} holds {holds}: "
            + ", ".join(f"{k} is {saved.get(k)!r} there, {here[k]!r} here" for k in wrong)
            + f" ({advice})"
        )
