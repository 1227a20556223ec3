"""What a CLI run says before its first rollout: each start-up stage as it happens, with its time,
on stderr and in ``run.log``; none of the warnings a user can do nothing about (Ray's notice of
token authentication, Megatron's start-up warnings), and still the ones that ask for something."""

from __future__ import annotations

import json
import os
import re
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

TIME = r"\(\d+\.\d s\)"
STAGES = (
    rf"ray: started a local instance at \S+ {TIME}",
    rf"rollout engine: embedded, ready {TIME}",
    r"building the actor's training stack on 1 rank\(s\)",
    rf"built the actor's training stack {TIME}",
    rf"decode kernel: (loaded|compiled) {TIME}",
    r"rollout 1/2 ",
)
"""The start-up stages, in the order they happen, up to the first rollout's progress line."""


def _in_order(text: str, patterns: tuple[str, ...]) -> list[int]:
    """Where each pattern first matches in ``text``; fails naming a pattern that is missing."""
    where = []
    for pattern in patterns:
        found = re.search(pattern, text)
        assert found is not None, f"{pattern!r} is not in:\n{text}"
        where.append(found.start())
    return where


def test_start_up_is_told_as_it_happens_and_only_useful_warnings_show(
    demo: Path, tmp_path: Path
) -> None:
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
    env = {**os.environ, "COLUMNS": "250"}  # rich wraps its log lines at the width it is given
    done = subprocess.run(
        [sys.executable, "-m", "rlcore_megatron.run", *flags],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    err, log = done.stderr, (out / "run.log").read_text()

    for text in (err, log):
        where = _in_order(text, STAGES)
        assert where == sorted(where), text
    for line in SILENCED:
        assert line not in err
    # A warning that asks the user to act still shows: prompts the model cannot hold.
    assert f"data: left out 1 of the 41 prompts in {data}: longer than" in err
