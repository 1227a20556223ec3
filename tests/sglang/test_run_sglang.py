"""`python -m rlcore_megatron.run --rollout-engine sglang`: the same loop with a real SGLang server
on the CPU (launched by the run in its own rollout slot, through a Ray host, and shut down by it),
Megatron training in a Ray actor and tensor weight sync from that rank after every step, in
buckets of --update-weight-buffer-size; then an eval-only run of the saved checkpoint through
SGLang with disk weight sync (written by the rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.launch.demo import prepare_demo

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _run(*flags: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "rlcore_megatron.run", *flags],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
    )


def test_grpo_then_eval_only_with_sglang(tmp_path: Path) -> None:
    demo = tmp_path / "demo"
    prepare_demo(demo)
    data = [
        "--hf-checkpoint",
        str(demo / "model"),
        "--input-key",
        "prompt",
        "--label-key",
        "answer",
        "--eval-prompt-data",
        "heldout",
        str(demo / "eval.jsonl"),
        "--rollout-engine",
        "sglang",
    ]
    train = _run(
        *data,
        "--prompt-data",
        str(demo / "train.jsonl"),
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "8",
        "--rollout-max-response-len",
        "5",
        "--lr",
        "1e-3",
        "--rollout-temperature",
        "0.7",
        "--update-weight-buffer-size",
        "20000",
        "--save",
        str(tmp_path / "ckpt"),
        "--skip-eval-before-train",
        "--eval-interval",
        "2",
        "--output-dir",
        str(tmp_path / "train"),
    )
    assert train.returncode == 0, train.stderr[-3000:]
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["trained"] == [1, 2] and summary["saved"] == [2]
    rows = [
        json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["rollout/weight_version"] for r in steps] == [1.0, 2.0]
    # SGLang's fp32 log-probs of its own samples at T = 0.7 agree with Megatron's recomputation:
    # both are of the tempered policy that sampled.
    assert all(r["train/actor/logprob_mismatch_max"] < 1e-3 for r in steps)
    assert (tmp_path / "train" / "sglang" / "sglang-0.log").is_file()  # the launched server's
    log = (tmp_path / "train" / "run.log").read_text()
    assert "actor: 1 rank(s) on CPU slots 0" in log and "rollout engine 0: CPU slots 1" in log

    evaluate = _run(
        *data,
        "--num-rollout",
        "0",
        "--load",
        str(tmp_path / "ckpt"),
        "--weight-sync",
        "disk",
        "--output-dir",
        str(tmp_path / "eval"),
    )
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["built"] == ["eval:actor"] and summary["evaluated"] == [2]
    assert "eval/heldout/reward" in summary["last_eval"]


def _demo_flags(demo: Path, *, rollouts: int) -> list[str]:
    """The demo's task and model with a launched SGLang server: ``rollouts`` rollouts of 4
    prompts x 2 samples, one optimizer step each, answers of at most 5 tokens."""
    # fmt: off
    return [
        "--hf-checkpoint", str(demo / "model"), "--input-key", "prompt", "--label-key", "answer",
        "--prompt-data", str(demo / "train.jsonl"), "--rollout-engine", "sglang",
        "--num-rollout", str(rollouts), "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
        "--global-batch-size", "8", "--micro-batch-size", "8", "--rollout-max-response-len", "5",
    ]
    # fmt: on


def test_free_running_generation_with_partial_rollouts(tmp_path: Path) -> None:
    """--max-staleness 2 --partial-rollout with a launched SGLang server: the generator runs up
    to two versions ahead, new weights pause the server mid-generation instead of waiting, and
    no trained sample is more than two versions old."""
    demo = tmp_path / "demo"
    prepare_demo(demo)
    run = _run(
        *_demo_flags(demo, rollouts=4),
        *("--lr", "1e-3", "--max-staleness", "2", "--partial-rollout"),
        *("--output-dir", str(tmp_path / "out")),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["trained"] == [1, 2, 3, 4]
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "rollout/staleness_max" in r]
    assert len(steps) == 4 and all(r["rollout/staleness_max"] <= 2 for r in steps)
    assert all("train/actor/tis_weight" in r for r in steps)


_KILLER = '''
import os
import signal
import time

from rlcore.rollout.default import default_rollout


def rollout(ctx):
    """The default rollout, but rollout 2 first kills the SGLang server outright."""
    if ctx.rollout_id == 2:
        engine = ctx.engine
        while hasattr(engine, "engine"):  # the loop's checked wrapper
            engine = engine.engine
        server = engine.servers[0]
        os.killpg(server.process.pid, signal.SIGKILL)
        while server.is_alive():
            time.sleep(0.05)
    return default_rollout(ctx)
'''


def test_a_killed_server_is_restarted_with_the_policy_and_the_run_goes_on(tmp_path: Path) -> None:
    """--use-fault-tolerance: the server dies before rollout 2; the run restarts it, the
    Megatron rank gives it the weights of version 2 (the trainer's log-probs of its samples agree
    with its own), the requests go again and the run ends as if nothing happened."""
    demo = tmp_path / "demo"
    prepare_demo(demo)
    (tmp_path / "killer.py").write_text(_KILLER)
    run = _run(
        *_demo_flags(demo, rollouts=3),
        *("--lr", "1e-2", "--use-fault-tolerance", "--rollout-function-path", "killer:rollout"),
        *("--output-dir", str(tmp_path / "out")),
        pythonpath=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["trained"] == [1, 2, 3]
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in rows if "rollout/reward" in r]
    assert [r["rollout/weight_version"] for r in steps] == [1.0, 2.0, 3.0]
    assert all(r["train/actor/logprob_mismatch"] < 1e-3 for r in steps), steps
    log = (tmp_path / "out" / "run.log").read_text()
    assert "exited with code -9" in log and "restarting it (1 of at most 3)" in log
    assert (tmp_path / "out" / "sglang" / "sglang-0.restart1.log").is_file()
