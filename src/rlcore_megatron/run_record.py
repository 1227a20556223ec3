"""What a run of ``python -m rlcore_megatron.run`` leaves in its output folder (``--output-dir``),
however it ends.

- ``summary.json``, on every exit the process lives through: ``status`` (``"ok"``, ``"failed"``,
  ``"interrupted"`` by Ctrl-C, or ``"stopped"`` by SIGTERM after a save), for a failed run the
  error's type and message, what the run built, trained, saved and evaluated (``last_trained``:
  the last rollout whose training finished), its last metrics and the latest checkpoint in
  ``--save``.
- ``run.log`` ends with a failed run's error, as the console does.
- One run per ``metrics.jsonl``: a run that does not continue the run recorded in the folder
  (anything but a training run resumed with ``--load``) first moves that run's files into
  ``previous/N/`` (:func:`start_output_folder`), so that no metrics file holds two runs with
  their steps starting again half-way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import attrs

from rlcore.checkpoint_files import find_checkpoint
from rlcore.config import RunConfig
from rlcore.errors import CheckpointError
from rlcore.loop import RunResult

__all__ = [
    "RUN_FILES",
    "interrupted_message",
    "latest_checkpoint",
    "resume_hint",
    "start_output_folder",
    "write_summary",
]

RUN_FILES = ("metrics.jsonl", "run.log", "summary.json")
"""The files a run writes into its output folder that belong to that run alone."""

Status = Literal["ok", "failed", "interrupted", "stopped"]


def start_output_folder(output_dir: Path, *, continues: bool) -> Path | None:
    """Unless this run ``continues`` the one whose files are in ``output_dir``, move those files
    into ``output_dir/previous/N`` (the first free ``N``) and return that folder."""
    found = [output_dir / name for name in RUN_FILES if (output_dir / name).exists()]
    if continues or not found:
        return None
    n = 1
    while (output_dir / "previous" / str(n)).exists():
        n += 1
    folder = output_dir / "previous" / str(n)
    folder.mkdir(parents=True)
    for path in found:
        path.rename(folder / path.name)
    return folder


def latest_checkpoint(config: RunConfig) -> Path | None:
    """The newest complete checkpoint in ``--save``, if any."""
    if config.checkpoint.save is None:
        return None
    try:
        return find_checkpoint(config.checkpoint.save)
    except CheckpointError:
        return None


def write_summary(
    path: Path, result: RunResult, config: RunConfig, error: BaseException | None = None
) -> None:
    """``summary.json`` for ``result``; ``error`` is what ended a failed run (a Ctrl-C's
    interruption is in ``result``)."""
    status: Status = "failed" if error is not None else "ok"
    if result.interrupted:
        status = "interrupted"
    elif result.stopped:
        status = "stopped"
    summary = {"status": status, **attrs.asdict(result)}
    if error is not None:
        summary["error"] = {"type": type(error).__name__, "message": str(error)}
    summary["last_trained"] = result.trained[-1] if result.trained else None
    latest = latest_checkpoint(config)
    summary["latest_checkpoint"] = None if latest is None else str(latest)
    path.write_text(json.dumps(summary, indent=1) + "\n")


def interrupted_message(result: RunResult, config: RunConfig) -> str:
    """What the console says after Ctrl-C: where the run stopped, what it trained, and how to
    resume it."""
    where = (
        f"at rollout {result.interrupted_at}"
        if result.interrupted_at is not None
        else "before the first rollout"
    )
    trained = (
        f"trained rollouts {result.trained[0]}..{result.trained[-1]}"
        if result.trained
        else "trained nothing"
    )
    return f"interrupted {where}: {trained}; {resume_hint(config)}; summary in " + str(
        config.output_dir / "summary.json"
    )


def resume_hint(config: RunConfig) -> str:
    """Where a stopped run can go on from: ``latest checkpoint DIR/rollout_N (resume with --load
    DIR)``, or ``no checkpoint``."""
    latest = latest_checkpoint(config)
    if latest is None:
        return "no checkpoint"
    return f"latest checkpoint {latest} (resume with --load {config.checkpoint.save})"
