"""A run stopped half-way leaves nothing behind. `kill -9` of the driver: every process it started
(Ray, the rank actors and what they started, such as Megatron's checkpoint writer) is gone within
seconds, and so are the ranks' shared-memory files. Ctrl-C: no traceback, exit 130, a summary
saying where the run stopped and which checkpoint to resume from, and no processes or files. The
next save removes what an interrupted one left.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlcore.checkpoint_files import find_checkpoint, read_meta
from rlcore.launch.signals import stop_on_signals
from rlcore.loop.metrics import read_jsonl_metrics
from rlcore.loop.records import Progress
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
    ("schedule", "sigint_ignored"),
    [([], False), (["--max-staleness", "2", "--partial-rollout"], False), ([], True)],
    ids=["synchronous", "free-running-generator", "started-as-a-background-job"],
)
def test_ctrl_c_stops_cleanly_with_a_summary_and_exit_130(
    demo: Path, tmp_path: Path, schedule: list[str], sigint_ignored: bool
) -> None:
    """Synchronous; with the generator running ahead in its own thread (which must stop too,
    mid-generation, without leaving the run hanging or a process behind); and started with
    SIGINT ignored, as a script's background job inherits it (the SIGINT was lost there, and
    the run trained to its end)."""
    save = tmp_path / "ckpt"
    # What a save killed half-way left here earlier: a temporary checkpoint folder.
    debris = save / ".tmp-rollout_000007-4242"
    shutil.copytree(demo / "model", debris / "actor")
    out = tmp_path / "out"
    with model_hub() as (env, requests):
        cli = WatchedCLI(
            [*_flags(demo, out, save), *schedule],
            tmp_path / "cli",
            env,
            sigint_ignored=sigint_ignored,
        )
        try:
            cli.wait_for(save / "rollout_000002" / "rlcore.json", timeout_s=600)
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
    # Rollouts by number, from 1: k's training may or may not have finished.
    assert summary["trained"] in (list(range(1, k)), list(range(1, k + 1)))
    latest = find_checkpoint(save)
    assert summary["latest_checkpoint"] == str(latest)
    assert latest.name == f"rollout_{summary['saved'][-1]:06d}"
    assert read_meta(latest).rollout_id + 1 == summary["saved"][-1]
    assert (
        f"interrupted at rollout {k}: trained rollouts 1..{summary['trained'][-1]}; latest "
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
    """A run that fails after start-up (here its reward, at rollout 3) exits 1 and says why on
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
        "    if calls > 16:  # rollouts 1 and 2 have 4 prompts x 2 samples\n"
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
    assert hint == f"latest checkpoint {save / 'rollout_000002'} (resume with --load {save})"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert "the grader is down" in summary["error"]["message"]
    assert summary["trained"] == [1, 2] and summary["last_trained"] == 2
    assert summary["latest_checkpoint"] == str(save / "rollout_000002")
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rollout_000002"]  # retain 1
    last_line = (out / "run.log").read_text().splitlines()[-1]
    assert " ERROR rlcore: run failed: " in last_line and "the grader is down" in last_line
    rows = read_jsonl_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2]
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
    kept = save / "rollout_000001"
    assert (
        f"error: CheckpointError: not enough space on the disk holding {save} for checkpoint "
        "rollout_000002: it needs about "
    ) in cli.stderr
    assert f"the latest checkpoint is still {kept}" in cli.stderr
    assert find_checkpoint(save) == kept
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rollout_000001"]
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


def _trained_rows(out: Path) -> list[dict[str, float]]:
    path = out / "metrics.jsonl"
    rows = read_jsonl_metrics(path) if path.exists() else []
    return [r for r in rows if "train/actor/loss" in r]


def test_sigterm_saves_then_stops_and_the_resumed_run_goes_on_exactly(
    demo: Path, tmp_path: Path
) -> None:
    """Preemption: SIGTERM to the driver mid-run. The rollout being trained is saved (the save
    interval would not have), the run exits with 143 and the resume command, nothing is left
    running; resumed from that save it trains what an uninterrupted run trains."""
    out, save = tmp_path / "out", tmp_path / "ckpt"
    cli = WatchedCLI([*_flags(demo, out, save), "--save-interval", "50"], tmp_path / "cli")
    try:
        deadline = time.monotonic() + 600
        while len(_trained_rows(out)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        cli.process.send_signal(signal.SIGTERM)
        code = cli.wait(timeout_s=300)
    finally:
        cli.kill_everything()
    assert code == 143, cli.stderr
    summary = json.loads((out / "summary.json").read_text())
    k = summary["last_trained"]
    assert summary["status"] == "stopped" and summary["saved"] == [k] and k >= 1
    saved = save / f"rollout_{k:06d}"
    stop_line = (
        f"stopped on request after rollout {k}: latest checkpoint {saved} (resume with --load "
        f"{save})"
    )
    # The line to resume with, on the console, at the end of run.log and in summary.json.
    assert cli.stderr.splitlines()[-1] == stop_line
    assert (summary["message"], summary["exit_code"]) == (stop_line, 143)
    log = (out / "run.log").read_text()
    assert "SIGTERM: the run stops once the rollout being trained is saved" in log
    assert log.splitlines()[-1].endswith(f" WARNING rlcore: {stop_line}")
    assert cli.survivors(within_s=SURVIVAL_S) == []
    assert cli.shared_memory_left() == []

    end = ["--num-rollout", str(k + 3)]
    straight = tmp_path / "straight"
    for flags in (
        [*_flags(demo, straight, straight / "ckpt"), *end],
        [*_flags(demo, out, save), *end, "--load", str(save)],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "rlcore_megatron.run", *flags],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    keys = ("step", "rollout/reward", "train/actor/loss", "train/actor/grad_norm")
    resumed = [[r[key] for key in keys] for r in _trained_rows(out)]
    assert resumed[-2:] == [[r[key] for key in keys] for r in _trained_rows(straight)][k + 1 :]
    # The resumed run's record follows the stopped one's in summary.json, not over it.
    attempts = json.loads((out / "summary.json").read_text())["attempts"]
    assert [(a["status"], a["exit_code"], a["resumed_from"]) for a in attempts] == [
        ("stopped", 143, None),
        ("ok", 0, str(saved)),
    ]
    assert attempts[0]["message"] == stop_line and attempts[1]["trained"] == [k + 1, k + 2, k + 3]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_second_stop_signal_stops_at_once(sig: signal.Signals) -> None:
    """The first asks for a stop after the next save; the second is Ctrl-C's immediate stop.
    The handlers are the process's own again afterwards."""
    progress = Progress()
    before = signal.getsignal(sig)
    with pytest.raises(KeyboardInterrupt), stop_on_signals(progress):
        os.kill(os.getpid(), sig)
        assert progress.stop.is_set()
        os.kill(os.getpid(), sig)
        time.sleep(5)  # the handler raises before this ends
    assert signal.getsignal(sig) == before


def test_two_stop_signals_that_python_sees_as_one_still_stop_at_once() -> None:
    """Both SIGTERMs arrive while the main thread is in a long C call (as the driver is in
    ``ray.get``): Python runs the handler once for the two, and the handler, counting the
    deliveries the C-level handler recorded, stops at once."""
    progress = Progress()
    pid = os.getpid()
    sender = subprocess.Popen(
        ["sh", "-c", f"sleep 0.3; kill -TERM {pid}; sleep 0.05; kill -TERM {pid}"]
    )
    try:
        with pytest.raises(KeyboardInterrupt), stop_on_signals(progress):
            # A C loop of a second or two that never looks at signals; the handler runs after.
            hashlib.pbkdf2_hmac("sha256", b"rlcore", b"salt", 8_000_000)
            time.sleep(5)  # not reached: the handler raises as the loop returns
    finally:
        sender.wait(timeout=30)
    assert sender.returncode == 0


def _rank_processes(cli: WatchedCLI) -> list[psutil.Process]:
    """The CLI's rank actors (Ray names their processes after the actor class), without the
    processes a rank forked (Megatron's checkpoint writer), which inherit its name."""
    named = {}
    for child in psutil.Process(cli.process.pid).children(recursive=True):
        try:
            if "RankWorker" in " ".join(child.cmdline()):
                named[child.pid] = child
        except psutil.NoSuchProcess:
            pass
    return [p for p in named.values() if p.ppid() not in named]


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_a_killed_rank_is_restarted_from_the_last_checkpoint_and_the_run_finishes(
    demo: Path, tmp_path: Path, backend: str
) -> None:
    """``--max-restarts 1``: kill -9 of a rank's actor after the first checkpoint. The run closes
    everything, resumes from the latest checkpoint and finishes with exit 0; every rollout is in
    metrics.jsonl once, nothing is left running. For every backend: the launcher restarts ranks,
    the backend's checkpoint brings them back."""
    out, save = tmp_path / "out", tmp_path / "ckpt"
    flags = [*_flags(demo, out, save), "--num-rollout", "6", "--save-interval", "2"]
    flags += ["--train-backend", backend]
    cli = WatchedCLI([*flags, "--max-restarts", "1"], tmp_path / "cli")
    try:
        cli.wait_for(save / "latest", timeout_s=600)
        ranks = _rank_processes(cli)
        assert len(ranks) == 1, ranks
        ranks[0].kill()
        code = cli.wait(timeout_s=600)
    finally:
        cli.kill_everything()
    assert code == 0, cli.stderr[-3000:]
    log = (out / "run.log").read_text()
    restarted = re.search(
        # Killed in a call or during a save (then inside the save's CheckpointError).
        r"WARNING rlcore: restart 1 of 1 \(.*rank 0's actor died.*\): from (\S+) after "
        r"rollout (\d+)",
        log,
        re.MULTILINE,
    )
    assert restarted is not None, log[-3000:]
    assert restarted.group(1) == str(save) and int(restarted.group(2)) in (2, 4)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["restarts"], summary["last_trained"]) == ("ok", 1, 6)
    assert [r["step"] for r in _trained_rows(out)] == [1, 2, 3, 4, 5, 6]
    assert read_meta(find_checkpoint(save)).rollout_id == 5
    assert cli.survivors(within_s=SURVIVAL_S) == []
    assert cli.shared_memory_left() == []
