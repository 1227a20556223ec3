"""Resumes that never mix two runs, through the CLI: every resume cuts ``metrics.jsonl`` (and
TensorBoard and W&B) back to the checkpoint it loads, the rows past it kept aside; a resume from
an older checkpoint into the same ``--save`` is refused, or with ``--rewind-save`` moves the
later checkpoints aside; a checkpoint written before rollouts were numbered by count resumes
where it stopped; and ``summary.json`` keeps each attempt's record, a refused one's included."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rlcore.checkpoint_files import find_checkpoint, read_meta
from rlcore.config.flags import load_config
from rlcore.launch.prepare import prepare
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


def test_resumes_never_mix_two_runs(demo: Path, tmp_path: Path) -> None:
    """A run fails after its third rollout (its grader, once), with rollout 2 its last save;
    its save folder is then renamed the way rlcore named checkpoints before rollouts were
    numbered by count. Resumed with --load into the same folders, it goes on from rollout 2:
    the third rollout's row, logged past the checkpoint, is kept aside, and each rollout is in
    metrics.jsonl once. Then the issue's repro: with checkpoints of rollouts 2 and 4 in the
    folder, resuming from 2 into it is refused, and with --rewind-save trains 3 and 4 again
    with the first rollout 4's checkpoint kept aside. TensorBoard and W&B (offline) log with
    it, and summary.json holds all six attempts, the three refused ones' included."""
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
    flags += ["--use-tensorboard", "--use-wandb"]
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

    # Resuming from the older checkpoint into the same folder would save over rollout 4's: it is
    # refused before anything starts, naming both and the ways out; and so are --lr nan and a
    # bad data line. Each refusal is recorded in summary.json, whose "ok" would otherwise be
    # read as theirs.
    older = ["--load", str(old)]
    code, err = _run([*flags, *older], tmp_path / "refused", env)
    assert code == 2, err[-3000:]
    assert err.splitlines()[1] == (
        f"  - checkpoint.save (--save): --load {old} resumes from rollout_000001 (rollout 2), "
        f"but {save}'s latest checkpoint is rollout_000004 (rollout 4): this run would save "
        f"over rollout_000004 and mix two runs in {save} (save into another folder (--save "
        f"NEW), or add --rewind-save to move the checkpoints after rollout 2 to "
        f"{save / 'rewound'}/N/ and cut metrics.jsonl back to it (slime and verl have no such "
        "flag: they save over the later checkpoints))"
    )
    code, err = _run([*flags, "--lr", "nan"], tmp_path / "nan", env)
    assert code == 2 and "optim.lr (--lr)" in err, err[-3000:]
    refused = _summary(out)
    assert (refused["status"], refused["exit_code"]) == ("refused", 2)
    assert "optim.lr (--lr)" in refused["error"]["message"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "407>", "answer": "704"}\n{"prompt": \n')
    resume_on_bad_data = [*flags, "--load", str(save), "--prompt-data", str(bad)]
    code, err = _run(resume_on_bad_data, tmp_path / "bad", env)
    assert code == 2 and f"{bad}:2" in err, err[-3000:]
    refused = _summary(out)
    assert (refused["status"], refused["exit_code"]) == ("refused", 2)
    assert refused["error"]["type"] == "DataError" and refused["message"] in err
    assert refused["message"].startswith(f"error: DataError: {bad}:2")
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rollout_000001", "rollout_000004"]
    assert _steps(out) == [1, 2, 3, 4]

    # --rewind-save: rollout 4's checkpoint and the rows after rollout 2 move aside, kept; the
    # run trains rollouts 3 and 4 again, and every step is logged once, in TensorBoard too.
    code, err = _run([*flags, *older, "--rewind-save"], tmp_path / "rewound", env)
    assert code == 0, err[-3000:]
    log = (out / "run.log").read_text()
    assert (
        f"checkpoints: --rewind-save moved rollout_000004 (past rollout_000001, which this run "
        f"resumes from) to {save / 'rewound' / '1'}"
    ) in log
    assert read_meta(save / "rewound" / "1" / "rollout_000004").rollout_id == 3
    assert sorted(p.name for p in save.iterdir()) == [
        "latest",
        "rewound",
        "rollout_000001",
        "rollout_000004",
    ]
    assert _steps(out) == [1, 2, 3, 4]
    assert [r["step"] for r in read_jsonl_metrics(out / "rewound" / "2" / "metrics.jsonl")] == [
        3,
        4,
    ]
    # tensorboard ships no type information (no py.typed, no stubs)
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("rollout/reward")] == [1, 2, 3, 4]
    # W&B (offline): each resume went on in the first run, rewound to the step after rollout 2.
    run_id = (out / "wandb" / "rlcore_run_id").read_text().strip()
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert [r.name.endswith(run_id) for r in runs] == [True, True, True]
    for resumed in runs[1:]:
        init = (resumed / "logs" / "debug.log").read_text()
        assert f"'branch_point': {{'run_id': '{run_id}', 'step': 3}}" in init
    attempts = _summary(out)["attempts"]
    assert [(a["status"], a["exit_code"], a["resumed_from"]) for a in attempts] == [
        ("failed", 1, None),
        ("ok", 0, str(old)),
        ("refused", 2, None),
        ("refused", 2, None),
        ("refused", 2, None),
        ("ok", 0, str(old)),
    ]


def test_a_save_folder_whose_only_save_was_interrupted_says_so(demo: Path, tmp_path: Path) -> None:
    """kill -9 during the first save leaves only its temporary folder in --save: --load of that
    folder says so and what to do (not that it was never written by --save), and a run started
    again without --load into the same folder passes every check."""
    out, save = tmp_path / "out", tmp_path / "ckpt"
    debris = save / ".tmp-rollout_000002-4242"  # what the killed save had written of rollout 2
    (debris / "actor").mkdir(parents=True)
    flags = _flags(demo, out, save)
    code, err = _run([*flags, "--load", str(save)], tmp_path / "cli", dict(os.environ))
    assert code == 2, err
    assert err.splitlines()[1] == (
        f"  - checkpoint.load (--load): {save} holds no checkpoint: its only save was "
        f"interrupted before it was complete (it left the temporary folder {debris.name}). Start "
        f"the run again without --load: its first save into {save} removes that folder (or "
        "delete it yourself)"
    )
    assert not out.exists() and debris.is_dir()  # refused before anything, nothing removed
    prepare(load_config(flags))  # again without --load: the folder is fine for a fresh run
