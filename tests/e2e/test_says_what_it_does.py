"""A run that says what it does: a path template it cannot use is refused by the flag's name
before anything starts, and a second stop signal stops at once however soon it follows the
first."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from rlcore.loop.metrics import read_jsonl_metrics
from tests.e2e.cli import WatchedCLI


def _flags(demo: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "train.jsonl")),
        *("--input-key", "prompt", "--label-key", "answer", "--rollout-batch-size", "4"),
        *("--n-samples-per-prompt", "2", "--global-batch-size", "8", "--micro-batch-size", "4"),
        *("--rollout-max-response-len", "5", "--lr", "1e-3", "--output-dir", str(out), *extra),
    ]


def test_a_path_with_a_brace_that_is_not_the_template_is_refused_by_its_flag(
    demo: Path, tmp_path: Path
) -> None:
    """slime's template is str.format with {rollout_id}: {step}, {} or an unclosed brace in any
    of the three flags that take one is a configuration error naming the flag, exit 2."""
    bad = {
        "--save-hf": "hf/{step}",
        "--save-debug-rollout-data": "rollouts/{}.json",
        "--load-debug-rollout-data": "rollouts/{rollout_id.json",
    }
    flags = [flag_or_path for pair in bad.items() for flag_or_path in pair]
    cli = WatchedCLI(_flags(demo, tmp_path / "out", *flags), tmp_path / "cli")
    try:
        assert cli.wait(timeout_s=300) == 2
    finally:
        cli.kill_everything()
    err = cli.stderr
    assert "Traceback" not in err and cli.seen == {}, err  # refused before anything started
    lines = err.splitlines()
    for flag, field in (
        ("checkpoint.save_hf (--save-hf)", "has {step}: the one field"),
        ("debug.save_debug_rollout_data (--save-debug-rollout-data)", "has {}: the one field"),
        ("debug.load_debug_rollout_data (--load-debug-rollout-data)", "brace that is not part"),
    ):
        assert any(line.startswith(f"  - {flag}: ") and field in line for line in lines), err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.megatron
def test_a_second_sigterm_50_ms_after_the_first_stops_at_once(demo: Path, tmp_path: Path) -> None:
    """Preempted twice in quick succession (a scheduler's TERM, then its retry): the second is
    not taken for the first. The run stops at once, as Ctrl-C does (exit 130, nothing saved;
    the save interval would not save for 50 rollouts), rather than training and saving one more
    rollout and exiting with 143."""
    out, save = tmp_path / "out", tmp_path / "ckpt"
    flags = _flags(demo, out, "--num-rollout", "100", "--save", str(save), "--save-interval", "50")
    cli = WatchedCLI(flags, tmp_path / "cli")
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not (
            (out / "metrics.jsonl").exists() and read_jsonl_metrics(out / "metrics.jsonl")
        ):
            cli.sample()
            time.sleep(0.2)
        cli.process.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        cli.process.send_signal(signal.SIGTERM)
        code = cli.wait(timeout_s=300)
    finally:
        cli.kill_everything()
    err = cli.stderr
    assert code == 130, err[-3000:]
    assert "interrupted at rollout " in err and "Traceback" not in err, err[-3000:]
    assert not (save / "latest").exists()  # stopped without the save a single SIGTERM makes
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert cli.survivors(within_s=30.0) == []
