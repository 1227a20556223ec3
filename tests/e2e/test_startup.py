"""What a CLI run says: none of the warnings a user can do nothing about (Ray's notice of token
authentication, Megatron's start-up warnings), and still the ones that ask for something."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]

SILENCED = (
    "Token authentication is enabled for this Ray cluster",
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "`load_state_dict` is deprecated",
    "Please use DTensor instead",
)
"""Lines every run printed before (Ray's, Megatron's): nothing to do about any of them."""


def test_only_warnings_that_ask_for_something_show(demo: Path, tmp_path: Path) -> None:
    data = tmp_path / "train.jsonl"
    rows = [json.loads(line) for line in (demo / "train.jsonl").read_text().splitlines()[:40]]
    rows.append({"prompt": "1" * 70 + ">", "answer": "1"})  # longer than the model's positions
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    flags = [
        *("--hf-checkpoint", str(demo / "model"), "--prompt-data", str(data)),
        *("--input-key", "prompt", "--label-key", "answer", "--num-rollout", "2"),
        *("--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8"),
        *("--micro-batch-size", "8", "--rollout-max-response-len", "5", "--output-dir", str(out)),
        *("--save", str(tmp_path / "ckpt")),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "rlcore_megatron.run", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    for line in SILENCED:
        assert line not in err
    # A warning that asks the user to act still shows: prompts the model cannot hold.
    assert f"data: left out 1 of the 41 prompts in {data}: longer than" in err
