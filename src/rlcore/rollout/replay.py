"""Rollouts saved to files and read back (slime's ``--save-debug-rollout-data`` and
``--load-debug-rollout-data``).

One JSON file per rollout id holds the groups the rollout trained on: every sample's prompt
(index, text, token ids, label), its generation (token ids, the engine's per-token log-probs,
text, finish reason, weight version) and its reward. Python floats survive JSON exactly, so a run
that trains on a replayed rollout sees bit for bit the numbers the original run saw.

``PATH`` is a template as slime's are (``str.format`` with ``{rollout_id}``, replaced by the
rollout's number, counted from 1 as checkpoints are:
:func:`~rlcore.checkpoint_files.rollout_path`); a path without braces is a folder holding
``rollout_000001.json`` (the first rollout's) and so on. Inside, each file records the
rollout's id, from 0. Files are written atomically.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Final

import cattrs

from rlcore.checkpoint_files import rollout_number, rollout_path
from rlcore.errors import DataError
from rlcore.protocols.rollout import RolloutOutput
from rlcore.samples import Sample

__all__ = [
    "FORMAT",
    "load_rollout_data",
    "read_groups",
    "read_output",
    "rollout_data_path",
    "save_rollout_data",
    "write_groups",
    "write_output",
]

FORMAT: Final = "rlcore.rollout/1"
"""The ``format`` field of every file; a file with another one is refused."""

_converter = cattrs.Converter(forbid_extra_keys=True)


def rollout_data_path(template: str, rollout_id: int) -> Path:
    """The file of rollout id ``rollout_id`` under ``template`` (module docstring), named by
    the rollout's number (:func:`~rlcore.checkpoint_files.rollout_path`)."""
    return rollout_path(template, rollout_id, ".json")


def save_rollout_data(
    template: str, rollout_id: int, groups: tuple[tuple[Sample, ...], ...]
) -> Path:
    """Write rollout ``rollout_id``'s ``groups`` to their file under ``template``; returns it."""
    path = rollout_data_path(template, rollout_id)
    write_groups(path, rollout_id, groups)
    return path


def load_rollout_data(template: str, rollout_id: int) -> tuple[tuple[Sample, ...], ...]:
    """The groups saved for rollout ``rollout_id`` under ``template`` (see :func:`read_groups`)."""
    path = rollout_data_path(template, rollout_id)
    if not path.is_file():
        raise DataError(
            f"{path}: no saved rollout {rollout_number(rollout_id)} for "
            f"--load-debug-rollout-data {template}; "
            "save it with --save-debug-rollout-data, or train fewer rollouts (--num-rollout)"
        )
    return read_groups(path, rollout_id)


def write_groups(path: Path, rollout_id: int, groups: tuple[tuple[Sample, ...], ...]) -> None:
    """``groups`` as rollout ``rollout_id``'s file at ``path``, written atomically (a temporary
    file renamed into place; the folder is created)."""
    _write(
        path, {"format": FORMAT, "rollout_id": rollout_id, "groups": _converter.unstructure(groups)}
    )


def write_output(path: Path, rollout_id: int, output: RolloutOutput) -> None:
    """A whole :class:`~rlcore.protocols.rollout.RolloutOutput` (groups, surplus and metrics) as
    rollout ``rollout_id``'s file at ``path``, atomically: a rollout generated ahead of training and
    saved with a checkpoint, to be trained on after a resume exactly as it would have been."""
    _write(
        path,
        {
            "format": FORMAT,
            "rollout_id": rollout_id,
            "groups": _converter.unstructure(output.groups),
            "surplus": _converter.unstructure(output.surplus),
            "metrics": dict(output.metrics),
        },
    )


def read_output(path: Path, rollout_id: int) -> RolloutOutput:
    """The :class:`~rlcore.protocols.rollout.RolloutOutput` :func:`write_output` wrote (errors as
    :func:`read_groups`')."""
    record = _read(path, rollout_id)
    try:
        surplus: tuple[tuple[Sample, ...], ...] = _converter.structure(
            record["surplus"], tuple[tuple[Sample, ...], ...]
        )
        metrics = {str(k): float(v) for k, v in record["metrics"].items()}
    except (KeyError, AttributeError, cattrs.BaseValidationError, ValueError, TypeError) as exc:
        raise DataError(
            f"{path}: malformed rollout output {rollout_number(rollout_id)}: {exc}"
        ) from exc
    return RolloutOutput(_groups(path, rollout_id, record), metrics, surplus)


def _write(path: Path, record: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_groups(path: Path, rollout_id: int) -> tuple[tuple[Sample, ...], ...]:
    """The groups of rollout ``rollout_id`` in the file ``path``. Raises
    :class:`~rlcore.errors.DataError` naming the file when it is unreadable, not JSON, of another
    format or rollout id, or malformed."""
    return _groups(path, rollout_id, _read(path, rollout_id))


def _read(path: Path, rollout_id: int) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"{path}: cannot read saved rollout {rollout_number(rollout_id)}: {exc}"
        ) from exc
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{path}: not a rollout file of format {FORMAT!r} (found {found!r}); "
            "point --load-debug-rollout-data at files written by --save-debug-rollout-data"
        )
    held = record.get("rollout_id")
    if held != rollout_id:
        what = rollout_number(held) if isinstance(held, int) else repr(held)
        raise DataError(
            f"{path}: holds rollout {what}, not {rollout_number(rollout_id)}; the file was "
            "renamed or the path template is wrong (files saved before rollouts were numbered "
            "from 1 are named one below: rename them one up)"
        )
    return record


def _groups(path: Path, rollout_id: int, record: dict[str, Any]) -> tuple[tuple[Sample, ...], ...]:
    try:
        groups: tuple[tuple[Sample, ...], ...] = _converter.structure(
            record["groups"], tuple[tuple[Sample, ...], ...]
        )
    except (KeyError, cattrs.BaseValidationError, ValueError, TypeError) as exc:
        raise DataError(f"{path}: malformed rollout {rollout_number(rollout_id)}: {exc}") from exc
    return groups
