"""Resumes that never mix two runs, through the CLI: every resume cuts ``metrics.jsonl`` back to
the checkpoint it loads (the rows past it kept aside), a checkpoint written before rollouts were
numbered by count resumes where it stopped, and ``summary.json`` keeps each attempt's record."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rlcore.checkpoint_files import find_checkpoint, read_meta
from rlcore.loop.metrics import read_jsonl_metrics
from tests.e2e.cli import WatchedCLI

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]


def _flags(demo: Path, out: Path, save: Path, *extra: str) -> list[str]:
    return [
        *("--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "train.jsonl")),
        *("--input-key", "prompt", "--label-key", "answer", "--rollout-batch-size", "4"),
        *("--n-samples-per-prompt", "2", "--global-batch-size", "8", "--micro-batch-size", "4"),
        *("--rollout-max-response-len", "5", "--lr", "1e-3", "--seed", "7"),
        *("--num-rollout", "4", "--save", str(save), "--save-interval", "2"),
        *("--output-dir", str(out), *extra),
    ]


def _run(flags: list[str], folder: Path, env: dict[str, str]) -> tuple[int, str]:
    cli = WatchedCLI(flags, folder, env)
    try:
        code = cli.wait(timeout_s=600)
    finally:
        cli.kill_everything()
    return code, cli.stderr


def _steps(out: Path, kind: str = "rollout/reward") -> list[int]:
    return [int(r["step"]) for r in read_jsonl_metrics(out / "metrics.jsonl") if kind in r]


def _summary(out: Path) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def test_resumes_cut_the_metrics_back_and_keep_every_attempts_record(
    demo: Path, tmp_path: Path
) -> None:
    """A run fails after its third rollout (its grader, once), with rollout 2 its last save;
    its save folder is then renamed the way rlcore named checkpoints before rollouts were
    numbered by count. Resumed with --load into the same folders, it goes on from rollout 2:
    the third rollout's row, logged past the checkpoint, is kept aside, and each rollout is in
    metrics.jsonl once."""
    out, save = tmp_path / "out", tmp_path / "ckpt"
    (tmp_path / "grader_once.py").write_text(
        "import pathlib\n\n"
        "calls = 0\n\n\n"
        "def reward(prompt, generation):\n"
        "    global calls\n"
        "    calls += 1\n"
        f"    failed = pathlib.Path({str(tmp_path / 'failed')!r})\n"
        "    if calls > 24 and not failed.exists():  # rollouts 1..3: 4 prompts x 2 samples each\n"
        "        failed.touch()\n"
        "        raise ValueError('the grader is down')\n"
        "    return 0.0\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    flags = _flags(demo, out, save, "--custom-rm-path", "grader_once:reward")
    code, err = _run(flags, tmp_path / "first", env)
    assert code == 1 and "the grader is down" in err, err[-3000:]
    assert _steps(out) == [1, 2, 3]  # the third rollout trained, but was not saved
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rollout_000002"]

    # The save folder as rlcore wrote it before rollouts were numbered by count: the checkpoint
    # after two rollouts named by its id, 1.
    old = (save / "rollout_000002").rename(save / "rollout_000001")
    (save / "latest").write_text("rollout_000001\n")
    assert read_meta(old).rollout_id == 1

    code, err = _run([*flags, "--load", str(save)], tmp_path / "resumed", env)
    assert code == 0, err[-3000:]
    assert _steps(out) == [1, 2, 3, 4]  # the third rollout once: this run's
    kept = read_jsonl_metrics(out / "rewound" / "1" / "metrics.jsonl")
    assert [r["step"] for r in kept] == [3]  # the failed attempt's, aside
    log = (out / "run.log").read_text()
    assert (
        f"metrics: the 1 rows logged after rollout 2 (by the attempt that went on past the "
        f"checkpoint) moved to {out / 'rewound' / '1' / 'metrics.jsonl'}"
    ) in log
    assert f"resuming from {old}: training goes on with rollout 3" in log
    assert find_checkpoint(save) == save / "rollout_000004"
    assert read_meta(save / "rollout_000004").rollout_id == 3
    summary = _summary(out)
    assert [(a["status"], a["exit_code"], a["resumed_from"]) for a in summary["attempts"]] == [
        ("failed", 1, None),
        ("ok", 0, str(old)),
    ]
    assert summary["trained"] == [3, 4] and summary["saved"] == [4]
