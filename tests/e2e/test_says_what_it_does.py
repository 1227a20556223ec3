"""A run that says what it does: a path template it cannot use is refused by the flag's name
before anything starts, and a second stop signal stops at once however soon it follows the
first."""

from __future__ import annotations

from pathlib import Path

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
