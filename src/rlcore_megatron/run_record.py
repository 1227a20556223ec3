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
- A restart (``--max-restarts``) goes on from the latest checkpoint (:func:`restart_config`) and
  first drops the rows the lost attempt logged after it (:func:`rewind_metrics`): every rollout
  appears in ``metrics.jsonl`` once, as the run that carried on trained it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import attrs

from rlcore.checkpoint_files import find_checkpoint, read_meta, rollout_number
from rlcore.config import RunConfig
from rlcore.errors import CheckpointError
from rlcore.loop import RunResult

__all__ = [
    "RUN_FILES",
    "interrupted_message",
    "latest_checkpoint",
    "numbered",
    "restart_config",
    "resume_hint",
    "rewind_metrics",
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


def restart_config(config: RunConfig) -> tuple[RunConfig, int | None]:
    """What a restart runs, and the rollout id it goes on after: the run resumed from the latest
    checkpoint in ``--save`` (its own, so with none of the resume flags a first ``--load`` may
    have needed), or, with no checkpoint yet, ``config`` itself from its start (``None``)."""
    latest = latest_checkpoint(config)
    if latest is None:
        return config, None
    checkpoint = attrs.evolve(
        config.checkpoint,
        load=config.checkpoint.save,
        start_rollout_id=None,
        overwrite_save=False,
        override_opt_param_scheduler=False,
        no_load_optim=False,
        no_load_rng=False,
        finetune=False,
    )
    return attrs.evolve(config, checkpoint=checkpoint), rollout_number(read_meta(latest).rollout_id)


def rewind_metrics(path: Path, through: int) -> int:
    """Drop the rows of the metrics file ``path`` logged after rollout number ``through`` (steps
    above it: that training was lost with the attempt); returns how many went. Rewritten
    atomically."""
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= through]
    if len(kept) < len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(f"{line}\n" for line in kept))
        os.replace(tmp, path)
    return len(lines) - len(kept)


def write_summary(
    path: Path,
    result: RunResult,
    config: RunConfig,
    error: BaseException | None = None,
    restarts: int = 0,
) -> None:
    """``summary.json`` for ``result``; ``error`` is what ended a failed run (a Ctrl-C's
    interruption is in ``result``); ``restarts``: how many times ``--max-restarts`` rebuilt
    the run."""
    status: Status = "failed" if error is not None else "ok"
    if result.interrupted:
        status = "interrupted"
    elif result.stopped:
        status = "stopped"
    summary = {"status": status, **numbered(result)}
    if error is not None:
        summary["error"] = {"type": type(error).__name__, "message": str(error)}
    summary["restarts"] = restarts
    latest = latest_checkpoint(config)
    summary["latest_checkpoint"] = None if latest is None else str(latest)
    path.write_text(json.dumps(summary, indent=1) + "\n")


def numbered(result: RunResult) -> dict[str, Any]:
    """``result`` as ``summary.json`` records it: every rollout by its number
    (:func:`~rlcore.checkpoint_files.rollout_number`, as the checkpoint folders and metrics
    steps name them; an evaluation before training is 0), and ``last_trained``, the number of
    the last rollout whose training finished."""
    record = attrs.asdict(result)
    for key in ("trained", "saved", "evaluated", "rollouts"):
        record[key] = [rollout_number(i) for i in record[key]]
    if result.interrupted_at is not None:
        record["interrupted_at"] = rollout_number(result.interrupted_at)
    record["last_trained"] = record["trained"][-1] if result.trained else None
    return record


def interrupted_message(result: RunResult, config: RunConfig) -> str:
    """What the console says after Ctrl-C: where the run stopped, what it trained, and how to
    resume it."""
    record = numbered(result)
    where = (
        f"at rollout {record['interrupted_at']}"
        if result.interrupted_at is not None
        else "before the first rollout"
    )
    done = record["trained"]
    trained = f"trained rollouts {done[0]}..{done[-1]}" if done else "trained nothing"
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
