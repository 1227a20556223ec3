"""mypy itself rejects ``eval_stack.optimizer``: the bug this project exists to prevent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SNIPPET = """
from rlcore.backend_api import EvalStack, TrainingStack

def evaluate_only(stack: EvalStack) -> None:
    for group in stack.optimizer.param_groups:
        group["lr"] = 0.0

def train(stack: TrainingStack) -> None:
    stack.optimizer.state_dict()
"""


@pytest.mark.slow
def test_mypy_rejects_optimizer_access_on_an_eval_stack(tmp_path: Path) -> None:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--config-file",
            str(root / "pyproject.toml"),
            str(snippet),
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert out.returncode == 1 and len(errors) == 1, out.stdout + out.stderr
    assert (
        'snippet.py:5: error: "EvalStack" has no attribute "optimizer"  [attr-defined]' in errors[0]
    )
