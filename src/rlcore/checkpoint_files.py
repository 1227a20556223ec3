"""Checkpoint folders as files: their layout, the core's record in each, and finding the one that
``--load`` means. The loop writes checkpoints (:mod:`rlcore.loop.checkpoints`); the loop, the
config (a run's saved settings) and a CLI's checks before start-up read them.

Layout under the ``--save`` folder::

    rollout_000003/          one folder per saved rollout
        actor/  critic/      written by each training stack's ``save``
        rlcore.json          rollout id, dataset position, stacks saved, the run's settings
                             (written last: a folder without it is not a checkpoint)
    latest                   text file naming the newest complete rollout folder
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rlcore.errors import CheckpointError

__all__ = [
    "LATEST_FILE",
    "META_FILE",
    "CheckpointMeta",
    "find_checkpoint",
    "read_meta",
    "saved_checkpoints",
    "rollout_dir_name",
]

META_FILE = "rlcore.json"
LATEST_FILE = "latest"


@attrs.frozen
class CheckpointMeta:
    """What the core records beside the stacks' own state."""

    rollout_id: int
    consumed_prompts: int
    stacks: tuple[str, ...]
    settings: Mapping[str, Any] = attrs.field(factory=dict)
    """The run's configuration as plain data, shaped like a ``--config`` TOML file (sections,
    and the chosen engine's own section): what a resumed or eval-only run compares with or takes
    its defaults from. Empty in checkpoints written before it was recorded."""


def rollout_dir_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:06d}"


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
            raise TypeError(f"settings is a {type(settings).__name__}, not an object")
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
