"""What a restart (``--max-restarts``) goes on from: the run's own latest checkpoint, with none of
the resume flags a first ``--load`` needed, and a metrics file without the lost attempt's rows;
and ``summary.json``'s history of attempts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from rlcore.checkpoint_files import CheckpointMeta
from rlcore.config import load_config
from rlcore.launch.record import (
    begin_attempt,
    mark_restarted,
    record_early_exit,
    restart_config,
    rewind_metrics,
    write_summary,
)
from rlcore.loop import RunResult
from rlcore.loop.checkpoints import write_checkpoint


def test_a_restart_resumes_from_the_runs_own_latest_checkpoint(tmp_path: Path) -> None:
    flags = [
        *("--num-rollout", "8", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--global-batch-size", "4", "--micro-batch-size", "1", "--max-restarts", "2"),
        *("--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "warm"), "--finetune"),
    ]
    config = load_config(flags)
    # No checkpoint of its own yet: the run starts again as it was given.
    assert restart_config(config) == (config, None)

    write_checkpoint(tmp_path / "ckpt", CheckpointMeta(3, 8, ("actor",)), {"actor": lambda p: None})
    restarted, through = restart_config(config)
    assert through == 4  # rollout id 3 is rollout 4, the step its metrics row has
    c = restarted.checkpoint
    assert (c.load, c.save, c.finetune, c.start_rollout_id) == (
        tmp_path / "ckpt",
        tmp_path / "ckpt",
        False,  # --finetune again would start over at rollout 1 with fresh optimizer state
        None,
    )
    assert c.max_restarts == 2 and restarted.rollout == config.rollout


def test_a_resume_moves_the_rows_past_its_checkpoint_aside(tmp_path: Path) -> None:
    """Resumed after rollout 2: the rows after it (an attempt that went on past the checkpoint)
    move to rewound/1/, and so does the evaluation at 2 when the resumed run evaluates before it
    trains (its own takes its place); the file keeps one row per rollout and evaluation."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval/h/reward": 0.0}]
    for step in (1, 2, 3):
        rows += [{"step": step, "rollout/reward": step}, {"step": step, "eval/h/reward": step}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rewound = rewind_metrics(tmp_path, 2, evaluates_again=True)
    assert (rewound.moved, rewound.kept_in) == (3, tmp_path / "rewound" / "1" / "metrics.jsonl")
    assert str(rewound) == (
        "metrics: the 3 rows logged after rollout 2 (by the attempt that went on past the "
        f"checkpoint) moved to {rewound.kept_in}"
    )
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]
    assert rewound.kept_in is not None
    assert [json.loads(line) for line in rewound.kept_in.read_text().splitlines()] == [
        rows[4],
        rows[5],
        rows[6],
    ]
    nothing = rewind_metrics(tmp_path, 2, evaluates_again=False)
    assert (nothing.moved, nothing.kept_in) == (0, None)
    assert not (tmp_path / "rewound" / "2").exists()
    assert rewind_metrics(tmp_path / "none", 0, evaluates_again=True).moved == 0


def _record(path: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary


def test_summary_json_keeps_every_attempts_record(tmp_path: Path) -> None:
    """Each attempt says it is running as it starts, then its record takes that place; one that
    died without writing it is "lost" when the next begins; an older summary without a history
    is its first attempt; and an exit before start is recorded only where a summary is."""
    config = load_config(["--num-rollout", "4", "--output-dir", str(tmp_path)])
    path = tmp_path / "summary.json"
    record_early_exit(tmp_path, "refused", ValueError("bad"), "error: bad")
    assert not path.exists()  # a refused run into a folder without a record leaves none
    path.write_text(json.dumps({"status": "ok", "trained": [1, 2]}))  # before the history
    begin_attempt(config, None)
    running = _record(path)
    assert running["status"] == "running" and running["exit_code"] is None
    assert [a["status"] for a in running["attempts"]] == ["ok", "running"]
    done = RunResult((0, 1), (1,), (-1, 1), {"eval/x": 1.0}, {}, stopped=True)
    write_summary(path, done, config, message="stopped on request after rollout 2: ...")
    stopped = _record(path)
    assert (stopped["status"], stopped["exit_code"], stopped["started"]) == (
        "stopped",
        143,
        running["started"],
    )
    assert (stopped["trained"], stopped["saved"], stopped["evaluated"]) == ([1, 2], [2], [0, 2])
    assert stopped["message"] == "stopped on request after rollout 2: ..."
    assert [a["status"] for a in stopped["attempts"]] == ["ok", "stopped"]
    # Killed: its "running" record stays until the next attempt says what became of it.
    begin_attempt(config, tmp_path / "ckpt" / "rollout_000002", restarts=0)
    record = _record(path)
    ended = subprocess.Popen(["true"])
    ended.wait()
    record["attempts"][-1]["pid"] = record["pid"] = ended.pid  # a process that has ended
    path.write_text(json.dumps(record))
    record_early_exit(tmp_path, "refused", ValueError("--lr nan"), "error: --lr nan")
    refused = _record(path)
    assert (refused["status"], refused["exit_code"], refused["trained"]) == ("refused", 2, [])
    assert refused["error"] == {"type": "ValueError", "message": "--lr nan"}
    history = refused["attempts"]
    assert [a["status"] for a in history] == ["ok", "stopped", "lost", "refused"]
    assert history[2]["resumed_from"] == str(tmp_path / "ckpt" / "rollout_000002")
    assert "without writing its record" in history[2]["message"]
    mark_restarted(path, "restart 1 of 1 (rank 0 died)")
    assert _record(path)["attempts"][-1]["restarted"] == "restart 1 of 1 (rank 0 died)"
    assert _record(path)["exit_code"] is None
