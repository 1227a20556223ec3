"""A run stopped half-way leaves nothing behind. `kill -9` of the driver: every process it started
(Ray, the rank actors and what they started, such as Megatron's checkpoint writer) is gone within
seconds, and so are the ranks' shared-memory files. Ctrl-C: no traceback, exit 130, a summary
saying where the run stopped and which checkpoint to resume from, and no processes or files. The
next save removes what an interrupted one left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from rlcore.checkpoint_files import find_checkpoint, read_meta
from rlcore.loop.metrics import read_jsonl_metrics
from tests.e2e.cli import WatchedCLI, model_hub
from tests.small_disk import SmallDisk

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]

SURVIVAL_S = 30.0
"""How long the processes of a stopped run may take to go."""


def _flags(demo: Path, out: Path, save: Path) -> list[str]:
    return [
        "--hf-checkpoint",
        str(demo / "model"),
        "--prompt-data",
        str(demo / "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "answer",
        "--num-rollout",
        "100",  # far more than the test waits for; one progress line per rollout
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--rollout-max-response-len",
        "5",
        "--lr",
        "1e-3",
        "--save",
        str(save),
        "--save-interval",
        "1",
        "--output-dir",
        str(out),
    ]


def test_kill_9_of_the_driver_leaves_no_process(demo: Path, tmp_path: Path) -> None:
    cli = WatchedCLI(_flags(demo, tmp_path / "out", tmp_path / "ckpt"), tmp_path / "cli")
    try:
        # After a save: the rank has started Megatron's checkpoint writer by then.
        cli.wait_for(tmp_path / "ckpt" / "latest", timeout_s=600)
        names = " ".join(cli.survivors(within_s=0))
        assert "ray::" in names and "multiprocessing.spawn" in names, names
        cli.process.send_signal(signal.SIGKILL)
        assert cli.wait(timeout_s=60) == -signal.SIGKILL
        assert cli.survivors(within_s=SURVIVAL_S) == []
        assert cli.shared_memory_left() == []
    finally:
        cli.kill_everything()


@pytest.mark.parametrize(
    "schedule",
    [[], ["--max-staleness", "2", "--partial-rollout"]],
    ids=["synchronous", "free-running-generator"],
)
def test_ctrl_c_stops_cleanly_with_a_summary_and_exit_130(
    demo: Path, tmp_path: Path, schedule: list[str]
) -> None:
    """Synchronous, and with the generator running ahead in its own thread (which must stop
    too, mid-generation, without leaving the run hanging or a process behind)."""
    save = tmp_path / "ckpt"
    # What a save killed half-way left here earlier: a temporary checkpoint folder.
    debris = save / ".tmp-rollout_000007-4242"
    shutil.copytree(demo / "model", debris / "actor")
    out = tmp_path / "out"
    with model_hub() as (env, requests):
        cli = WatchedCLI([*_flags(demo, out, save), *schedule], tmp_path / "cli", env)
        try:
            cli.wait_for(save / "rollout_000001" / "rlcore.json", timeout_s=600)
            cli.interrupt()
            code = cli.wait(timeout_s=300)
        finally:
            cli.kill_everything()
    err = cli.stderr
    assert code == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    k = summary["interrupted_at"]
    assert summary["trained"] == list(range(k)) or summary["trained"] == list(range(k + 1))
    latest = find_checkpoint(save)
    assert summary["latest_checkpoint"] == str(latest)
    assert read_meta(latest).rollout_id == summary["saved"][-1]
    assert (
        f"interrupted at rollout {k}: trained rollouts 0..{summary['trained'][-1]}; latest "
        f"checkpoint {latest} (resume with --load {save}); summary in {out / 'summary.json'}"
    ) in err
    assert cli.survivors(within_s=SURVIVAL_S) == []
    assert cli.shared_memory_left() == []
    # The first save removed the interrupted one's folder and said so.
    assert not debris.exists()
    log = (out / "run.log").read_text()
    assert f"checkpoints: removed {debris}, left behind by an interrupted save" in log
    # Not a terminal: one plain progress line per few rollouts, with the count and the time.
    assert re.search(r"rollout \d+/100  \d:\d\d:\d\d  rollout/reward=", err), err
    # Quiet: no Ray token-auth warning, no weight-loading bars.
    assert "Token authentication" not in err and "Loading weights" not in err, err
    assert requests == []  # the local model folder never sent anything to a model hub
    rows = read_jsonl_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "rollout/reward" in r] == summary["trained"]


def test_a_failed_run_leaves_its_record_and_the_earlier_runs_files_aside(
    demo: Path, tmp_path: Path
) -> None:
    """A run that fails after start-up (here its reward, at rollout 2) exits 1 and says why on
    stderr, at the end of run.log and in summary.json (with --save-retain 1, the one checkpoint
    kept is the latest). The earlier run that wrote into the same
    output folder keeps its files, moved aside; the new metrics file holds this run alone."""
    out, save = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    earlier = {"metrics.jsonl": '{"step": 0, "rollout/reward": 1.0}\n', "summary.json": "{}\n"}
    for name, text in earlier.items():
        (out / name).write_text(text)
    (tmp_path / "flaky_grader.py").write_text(
        "calls = 0\n\n\n"
        "def reward(prompt, generation):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls > 16:  # rollouts 0 and 1 have 4 prompts x 2 samples\n"
        "        raise ValueError('the grader is down')\n"
        "    return 0.0\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    flags = [
        *_flags(demo, out, save),
        "--custom-rm-path",
        "flaky_grader:reward",
        "--save-retain",
        "1",
    ]
    cli = WatchedCLI(flags, tmp_path / "cli", env)
    try:
        code = cli.wait(timeout_s=600)
    finally:
        cli.kill_everything()
    assert code == 1, cli.stderr
    *_, error, hint = cli.stderr.splitlines()
    assert error.startswith("error: RewardError: ") and "the grader is down" in error, cli.stderr
    assert hint == f"latest checkpoint {save / 'rollout_000001'} (resume with --load {save})"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "the grader is down" in summary["error"]["message"]
    assert summary["trained"] == [0, 1] and summary["last_trained"] == 1
    assert summary["latest_checkpoint"] == str(save / "rollout_000001")
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rollout_000001"]  # retain 1
    last_line = (out / "run.log").read_text().splitlines()[-1]
    assert " ERROR rlcore: run failed: " in last_line and "the grader is down" in last_line
    rows = read_jsonl_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "rollout/reward" in r] == [0, 1]
    for name, text in earlier.items():
        assert (out / "previous" / "1" / name).read_text() == text
    assert cli.survivors(within_s=SURVIVAL_S) == []


def test_a_full_disk_stops_the_run_before_a_save_and_keeps_the_last_checkpoint(
    demo: Path, tmp_path: Path, small_disk: SmallDisk
) -> None:
    """--save on a real 2 MiB disk: the first checkpoint (about 1.2 MiB) fits, the second
    cannot, and the run says so before writing it (exit 1), with the checkpoint kept. Then that
    checkpoint loses Megatron's index file, and loading it is refused before anything starts."""
    out, save = tmp_path / "out", small_disk(2 * 2**20)
    cli = WatchedCLI(_flags(demo, out, save), tmp_path / "cli")
    try:
        code = cli.wait(timeout_s=600)
    finally:
        cli.kill_everything()
    assert code == 1, cli.stderr
    kept = save / "rollout_000000"
    assert (
        f"error: CheckpointError: not enough space on the disk holding {save} for checkpoint "
        "rollout_000001: it needs about "
    ) in cli.stderr
    assert f"the latest checkpoint is still {kept}" in cli.stderr
    assert find_checkpoint(save) == kept
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rollout_000000"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["latest_checkpoint"] == str(kept)
    assert cli.survivors(within_s=SURVIVAL_S) == []

    # Megatron's checkpoint index deleted: --load of it is refused before anything starts.
    metadata = kept / "actor" / "model" / ".metadata"
    metadata.unlink()
    again = WatchedCLI(
        [*_flags(demo, tmp_path / "out2", tmp_path / "ckpt2"), "--load", str(save)],
        tmp_path / "cli2",
    )
    assert again.wait(timeout_s=300) == 2
    assert f"checkpoint {kept} is damaged: {metadata} is missing" in again.stderr, again.stderr
    assert again.seen == {}  # nothing started
