"""The launcher picks its training backend by name (``--train-backend``): through either entry
(``python -m rlcore.launch``, ``python -m rlcore_megatron.run``), refused before anything starts
when it is unknown or cannot split a model as asked (issue #35)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.launch.cli import main

pytestmark = [pytest.mark.megatron]


def _flags(demo: Path, out: Path, *extra: str) -> list[str]:
    # fmt: off
    return [
        "--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "answer", "--num-rollout", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
        "--micro-batch-size", "4", "--output-dir", str(out), *extra,
    ]
    # fmt: on


def test_both_entries_are_the_launcher_and_offer_the_backend_flag() -> None:
    for module in ("rlcore.launch", "rlcore_megatron.run"):
        done = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert "--train-backend" in done.stdout and "--rollout-engine" in done.stdout


def test_an_unknown_backend_is_refused_naming_the_flag(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_flags(demo, tmp_path / "out", "--train-backend", "jax")) == 2
    err = capsys.readouterr().err
    assert "model.train_backend (--train-backend)" in err and "megatron" in err, err
    assert not (tmp_path / "out").exists()


def test_a_split_the_backend_cannot_make_is_refused_before_anything_starts(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Megatron's kind refuses pipeline stages: said before Ray or any model starts."""
    flags = _flags(demo, tmp_path / "out", "--pipeline-model-parallel-size", "2")
    assert main([*flags, "--actor-num-gpus-per-node", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        "model.train_backend (--train-backend): the actor: the megatron backend does not cut" in err
    )
    assert "ray: started" not in err and not (tmp_path / "out").exists()
