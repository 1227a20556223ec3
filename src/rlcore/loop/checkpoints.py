"""Checkpoint folders, written atomically.

Layout under the ``--save`` folder::

    rollout_000003/          one folder per saved rollout
        actor/  critic/      written by each training stack's ``save``
        rlcore.json          rollout id, dataset position, stacks saved (written last)
    latest                   text file naming the newest complete rollout folder

A save is built in a hidden temporary folder, renamed into place, and only then is ``latest``
replaced (by ``os.replace`` of a temporary file). A crash or an exception at any point leaves the
previous checkpoint as ``latest``: a failed save never replaces a good one. A killed process
cannot remove its temporary folder (a whole checkpoint's size), so every save first removes the
ones an earlier, interrupted save left behind, and logs each: a save folder belongs to one run at
a time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from rlcore.errors import CheckpointError

__all__ = [
    "CheckpointMeta",
    "find_checkpoint",
    "read_meta",
    "remove_interrupted_saves",
    "rollout_dir_name",
    "write_checkpoint",
]

META_FILE = "rlcore.json"
LATEST_FILE = "latest"
_DEBRIS = (".tmp-rollout_*", ".old-rollout_*", f".{LATEST_FILE}.tmp")
"""What an interrupted :func:`write_checkpoint` can leave in the save folder."""

log = logging.getLogger("rlcore")


@attrs.frozen
class CheckpointMeta:
    """What the core records beside the stacks' own state."""

    rollout_id: int
    consumed_prompts: int
    stacks: tuple[str, ...]


def rollout_dir_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:06d}"


def _fsync_write(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(
    root: Path,
    meta: CheckpointMeta,
    save_stacks: Mapping[str, Callable[[Path], None]],
) -> Path:
    """Save every stack (``save_stacks[name](folder)``) into one new checkpoint, atomically.

    Returns the final folder. On any failure the temporary folder is removed, ``latest`` is left
    as it was, and :class:`CheckpointError` (naming the folder) is raised from the cause.
    """
    root.mkdir(parents=True, exist_ok=True)
    remove_interrupted_saves(root)
    name = rollout_dir_name(meta.rollout_id)
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        for stack_name, save in save_stacks.items():
            save(tmp / stack_name)
        _fsync_write(tmp / META_FILE, json.dumps(attrs.asdict(meta), indent=1))
        if final.exists():  # re-saving the same rollout id: move the old one aside first
            old = root / f".old-{name}-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        pointer = root / f".{LATEST_FILE}.tmp"
        _fsync_write(pointer, name + "\n")
        os.replace(pointer, root / LATEST_FILE)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint {final} failed: {exc}") from exc
    return final


def remove_interrupted_saves(root: Path) -> list[Path]:
    """Remove what interrupted saves left in the save folder ``root`` (their temporary folders);
    returns the paths removed, each also logged."""
    removed = []
    for pattern in _DEBRIS:
        for path in sorted(root.glob(pattern)):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            log.info("checkpoints: removed %s, left behind by an interrupted save", path)
            removed.append(path)
    return removed


def find_checkpoint(path: Path) -> Path:
    """The rollout folder that ``--load PATH`` means: PATH itself when it holds ``rlcore.json``,
    else the folder named by ``PATH/latest``. Raises :class:`CheckpointError` naming the path."""
    if (path / META_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if not path.exists():
        raise CheckpointError(f"checkpoint folder {path} does not exist; check --load")
    if not latest.is_file():
        raise CheckpointError(
            f"{path} is neither a checkpoint (no {META_FILE}) nor a save folder "
            f"(no '{LATEST_FILE}' file); point --load at a folder written by --save"
        )
    target = path / latest.read_text().strip()
    if not (target / META_FILE).is_file():
        raise CheckpointError(f"{latest} names {target}, which is not a complete checkpoint")
    return target


def read_meta(folder: Path) -> CheckpointMeta:
    """The core's record in a rollout folder; :class:`CheckpointError` names the file if corrupt."""
    path = folder / META_FILE
    try:
        raw = json.loads(path.read_text())
        return CheckpointMeta(
            rollout_id=int(raw["rollout_id"]),
            consumed_prompts=int(raw["consumed_prompts"]),
            stacks=tuple(str(s) for s in raw["stacks"]),
        )
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: not a complete checkpoint") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is corrupt: {exc}") from exc
