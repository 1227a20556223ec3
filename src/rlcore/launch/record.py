"""What a run of ``python -m rlcore_megatron.run`` leaves in its output folder (``--output-dir``),
however it ends.

- ``summary.json``: the run's record, attempt by attempt (``attempts``; the README lists the
  fields). An attempt says it is ``"running"`` as it starts (:func:`begin_attempt`), and every
  exit the process lives through writes how it ended (:func:`write_summary`): ``status``
  (``"ok"``, ``"failed"``, ``"interrupted"`` by Ctrl-C, ``"stopped"`` by SIGTERM after a save)
  and ``exit_code``, the console's last lines, a failure's error, what it built, trained, saved
  and evaluated (by rollout number; ``last_trained``: the last rollout whose training finished),
  its last metrics and the latest checkpoint in ``--save``; the latest attempt's record is also
  the top level. A run refused before it starts adds its record to a ``summary.json`` already
  there (:func:`record_early_exit`).
- ``run.log`` ends with what the console ends with: a failed run's error, the stop line, ...
- One run per ``metrics.jsonl``: a run that does not continue the run recorded in the folder
  (anything but a training run resumed with ``--load``) first moves that run's files into
  ``previous/N/`` (:func:`start_output_folder`), so that no metrics file holds two runs with
  their steps starting again half-way.
- Every resume (``--load``, a ``--max-restarts`` restart from the latest checkpoint:
  :func:`restart_config`) first moves the rows an earlier attempt logged past the checkpoint it
  loads into ``rewound/N/`` (:func:`rewind_metrics`): every rollout appears in
  ``metrics.jsonl`` once, as the run that carried on trained it.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from rlcore.checkpoint_files import find_checkpoint, read_meta, rollout_number
from rlcore.config import RunConfig
from rlcore.errors import CheckpointError
from rlcore.loop import RunResult
from rlcore.loop.preflight import first_free

__all__ = [
    "EXIT_CODES",
    "RUN_FILES",
    "RewoundRows",
    "begin_attempt",
    "interrupted_message",
    "latest_checkpoint",
    "mark_restarted",
    "numbered",
    "outcome_lines",
    "record_early_exit",
    "restart_config",
    "resume_hint",
    "rewind_metrics",
    "start_output_folder",
    "status_of",
    "write_summary",
]

RUN_FILES = ("metrics.jsonl", "run.log", "summary.json")
"""The files a run writes into its output folder that belong to that run alone."""

Status = Literal["running", "ok", "failed", "interrupted", "stopped", "refused", "lost"]


def start_output_folder(output_dir: Path, *, continues: bool) -> Path | None:
    """Unless this run ``continues`` the one whose files are in ``output_dir``, move those files
    into ``output_dir/previous/N`` (the first free ``N``) and return that folder."""
    found = [output_dir / name for name in RUN_FILES if (output_dir / name).exists()]
    if continues or not found:
        return None
    folder = first_free(output_dir / "previous")
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
        rewind_save=False,
        override_opt_param_scheduler=False,
        no_load_optim=False,
        no_load_rng=False,
        finetune=False,
    )
    return attrs.evolve(config, checkpoint=checkpoint), rollout_number(read_meta(latest).rollout_id)


def rewind_metrics(output_dir: Path, through: int, *, evaluates_again: bool) -> RewoundRows:
    """Cut ``output_dir/metrics.jsonl`` back to a resume from rollout number ``through``: the
    rows logged after it (the attempt that logged them went on past the checkpoint the run
    resumes from) and, when the resumed run ``evaluates_again`` before it trains, the
    evaluation at ``through`` (it logs its own, of the same weights) move to
    ``output_dir/rewound/N/metrics.jsonl`` (the first free ``N``), kept, not deleted. Every
    rollout and evaluation is then in ``metrics.jsonl`` once, as the run that carried on logged
    it. Rewritten atomically; nothing moves when nothing is past the checkpoint."""
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return RewoundRows(through, 0, None)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines]
    past = [
        row["step"] > through
        or (evaluates_again and row["step"] == through and any(k.startswith("eval/") for k in row))
        for row in rows
    ]
    moved = [line for line, out in zip(lines, past, strict=True) if out]
    if not moved:
        return RewoundRows(through, 0, None)
    folder = first_free(output_dir / "rewound")
    folder.mkdir(parents=True)
    (folder / path.name).write_text("".join(f"{line}\n" for line in moved))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line, out in zip(lines, past, strict=True) if not out))
    os.replace(tmp, path)
    return RewoundRows(through, len(moved), folder / path.name)


@attrs.frozen
class RewoundRows:
    """What :func:`rewind_metrics` did: the rollout number it cut back to, how many rows it
    moved, and where they are now."""

    through: int
    moved: int
    kept_in: Path | None

    def __str__(self) -> str:
        return (
            f"metrics: the {self.moved} rows logged after rollout {self.through} (by the attempt "
            f"that went on past the checkpoint) moved to {self.kept_in}"
        )


EXIT_CODES: Mapping[str, int] = {
    "ok": 0,
    "failed": 1,
    "refused": 2,
    "interrupted": 130,
    "stopped": 143,
}
"""The CLI's exit status for each way a run ends (``python -m rlcore_megatron.run``): a run
stopped by SIGTERM or SIGUSR1 after its save exits as a SIGTERM does (128 + 15), one Ctrl-C
stopped as a SIGINT does (128 + 2)."""


def status_of(result: RunResult, error: BaseException | None) -> Status:
    """How an attempt that got as far as ``result`` ended: ``error`` is what failed it (a
    Ctrl-C's interruption is in ``result``)."""
    if result.interrupted:
        return "interrupted"
    if result.stopped:
        return "stopped"
    return "failed" if error is not None else "ok"


def begin_attempt(config: RunConfig, resumed_from: Path | None, restarts: int = 0) -> None:
    """Say in ``summary.json`` that an attempt of the run is under way (``"running"``, with the
    process's id), appended to the history of the attempts in the output folder, so that no
    reader takes an earlier attempt's record for this one's."""
    record = _record("running", RunResult((), (), (), {}, {}), config, restarts, resumed_from)
    record["pid"] = os.getpid()
    _append(config.output_dir / "summary.json", record)


def write_summary(
    path: Path,
    result: RunResult,
    config: RunConfig,
    error: BaseException | None = None,
    restarts: int = 0,
    *,
    resumed_from: Path | None = None,
    message: str = "",
) -> None:
    """``summary.json`` for the attempt that ended with ``result``: its record in place of the
    ``"running"`` one :func:`begin_attempt` wrote (or appended, without one). ``error`` is what
    ended a failed attempt (a Ctrl-C's interruption is in ``result``); ``restarts``: how many
    times ``--max-restarts`` rebuilt the run before it; ``message``: what the console said at
    the end."""
    record = _record(status_of(result, error), result, config, restarts, resumed_from)
    if error is not None:
        record["error"] = _error(error)
    record["message"] = message
    _append(path, record, replacing_running=True)


def record_early_exit(
    output_dir: Path, status: Status, error: BaseException | None, message: str
) -> None:
    """A run that ends before it starts (``refused`` by its checks, exit 2, or ``interrupted``
    by Ctrl-C during them) into an output folder that has a ``summary.json``: its record is
    appended there, so that a job reading the file does not take an earlier run's success for
    this one's. With no ``summary.json`` nothing is written (a refused run leaves nothing)."""
    path = output_dir / "summary.json"
    if not path.is_file():
        return
    record: dict[str, Any] = {
        "status": status,
        "exit_code": EXIT_CODES[status],
        **numbered(RunResult((), (), (), {}, {}, interrupted=status == "interrupted")),
        "started": _now(),
        "ended": _now(),
        "resumed_from": None,
        "restarts": 0,
        "latest_checkpoint": None,
        "message": message,
    }
    if error is not None:
        record["error"] = _error(error)
    _append(path, record)


def mark_restarted(path: Path, restart: str) -> None:
    """The last attempt in ``summary.json`` did not end the process: ``--max-restarts`` went on
    with another (``restart`` says which and why)."""
    attempts = _attempts(path)
    if attempts:
        attempts[-1] = {**attempts[-1], "exit_code": None, "restarted": restart}
        _write(path, attempts)


def _record(
    status: Status,
    result: RunResult,
    config: RunConfig,
    restarts: int,
    resumed_from: Path | None,
) -> dict[str, Any]:
    latest = latest_checkpoint(config)
    return {
        "status": status,
        "exit_code": EXIT_CODES.get(status),
        **numbered(result),
        "started": _now(),
        "ended": None if status == "running" else _now(),
        "resumed_from": None if resumed_from is None else str(resumed_from),
        "restarts": restarts,
        "latest_checkpoint": None if latest is None else str(latest),
    }


def _error(error: BaseException) -> dict[str, str]:
    return {"type": type(error).__name__, "message": str(error)}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


_ATTEMPT_KEYS = (
    "status",
    "exit_code",
    "started",
    "ended",
    "resumed_from",
    "trained",
    "saved",
    "last_trained",
    "interrupted_at",
    "latest_checkpoint",
    "error",
    "message",
    "pid",
    "restarted",
)
"""What each attempt in the history keeps of its record (the whole of it is at the top level
while it is the latest)."""


def _append(path: Path, record: dict[str, Any], *, replacing_running: bool = False) -> None:
    """``record`` as the latest attempt of ``summary.json`` at ``path``, at the end of the
    history: taking the place of this process's ``"running"`` record (``replacing_running``);
    a ``"running"`` attempt before it whose process is gone becomes ``"lost"``."""
    attempts = _attempts(path)
    mine = [
        i
        for i, a in enumerate(attempts)
        if replacing_running and a.get("status") == "running" and a.get("pid") == os.getpid()
    ]
    if mine:  # (the last one, unless a run refused meanwhile recorded itself after it)
        record["started"] = attempts.pop(mine[-1]).get("started", record["started"])
    last = attempts[-1] if attempts else {}
    if last.get("status") == "running" and not _alive(last.get("pid")):
        attempts[-1] = {
            **last,
            "status": "lost",
            "message": "the process ended without writing its record (killed, or its machine "
            "went down)",
        }
    attempts.append(record)
    _write(path, attempts)


def _alive(pid: object) -> bool:
    """Whether the process ``pid`` (a record's) is still there."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


def _attempts(path: Path) -> list[dict[str, Any]]:
    """The full records of the attempts ``summary.json`` holds, oldest first (the latest in
    full, the earlier ones as the history kept them); one written before the history was kept
    counts as one attempt."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(summary, dict):
        return []
    history = summary.get("attempts")
    if not isinstance(history, list):
        return [summary] if "status" in summary else []
    earlier = [a for a in history[:-1] if isinstance(a, dict)]
    latest = {k: v for k, v in summary.items() if k != "attempts"}
    return [*earlier, latest]


def _write(path: Path, attempts: list[dict[str, Any]]) -> None:
    """``summary.json``: the latest attempt's whole record at the top level (the fields tools
    read), and ``attempts``, every attempt's, oldest first. Written atomically."""
    history = [{k: a[k] for k in _ATTEMPT_KEYS if k in a} for a in attempts]
    summary = {**attempts[-1], "attempts": history}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, path)


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


def outcome_lines(result: RunResult, config: RunConfig, error: BaseException | None) -> list[str]:
    """What the console says as a run ends (its last lines on stderr), which ``summary.json``
    keeps as the attempt's ``message`` and, but for a failure's (whose error ends the log
    already), ``run.log`` too: the error and where to resume from; where Ctrl-C stopped it; the
    rollout a stop request saved and how to resume; or what a finished run did."""
    status = status_of(result, error)
    if status == "failed":
        return [f"error: {type(error).__name__}: {error}", resume_hint(config)]
    if status == "interrupted":
        return [interrupted_message(result, config)]
    record = numbered(result)
    if status == "stopped":
        return [f"stopped on request after rollout {record['last_trained']}: {resume_hint(config)}"]
    if record["trained"]:
        trained = f"rollouts {record['trained'][0]}..{record['trained'][-1]}"
    elif record["rollouts"]:
        trained = (
            f"nothing (rollout-only: rollouts {record['rollouts'][0]}..{record['rollouts'][-1]})"
        )
    else:
        trained = "nothing (eval-only)"
    evals = {k: round(v, 4) for k, v in result.last_eval.items()}
    return [
        f"done: trained {trained}, saved {record['saved']}, built {list(result.built)}, "
        f"last eval {evals}"
    ]


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
