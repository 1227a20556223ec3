"""Checkpoint folders, written atomically (their layout: :mod:`rlcore.checkpoint_files`).

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

from rlcore.checkpoint_files import (
    LATEST_FILE,
    META_FILE,
    CheckpointMeta,
    rollout_dir_name,
)
from rlcore.errors import CheckpointError

__all__ = ["remove_interrupted_saves", "write_checkpoint"]

_DEBRIS = (".tmp-rollout_*", ".old-rollout_*", f".{LATEST_FILE}.tmp")
"""What an interrupted :func:`write_checkpoint` can leave in the save folder."""

log = logging.getLogger("rlcore")


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
    """Save every stack (``save_stacks[name](folder)``, each given a folder of its own that this
    function has created, empty) into one new checkpoint, atomically.

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
            part = tmp / stack_name
            part.mkdir()
            save(part)
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
