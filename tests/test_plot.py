"""python -m rlcore.plot: a run's curves and its held-out table from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.plot import curves, heldout_table, main

ROWS = [
    {"step": 0, "eval/heldout/reward": 0.0},
    {
        "step": 0,
        "rollout/reward": 0.1,
        "rollout/entropy": 2.0,
        "perf/generate_s": 0.5,
        "perf/train_s": 1.0,
    },
    {
        "step": 1,
        "rollout/reward": 0.3,
        "rollout/entropy": 1.5,
        "perf/generate_s": 0.5,
        "perf/train_s": 0.5,
    },
    {"step": 2, "eval/heldout/reward": 0.75, "eval/other/reward": 0.5},
]


def test_curves_pick_each_panels_metrics() -> None:
    found = curves(ROWS)
    assert found["sampled reward"] == {"rollout/reward": [(0, 0.1), (1, 0.3)]}
    assert found["held-out accuracy"] == {
        "eval/heldout/reward": [(0, 0.0), (2, 0.75)],
        "eval/other/reward": [(2, 0.5)],
    }
    assert found["entropy"] == {"rollout/entropy": [(0, 2.0), (1, 1.5)]}
    assert found["seconds per step"] == {"perf/step_s": [(0, 1.5), (1, 1.0)]}
    assert found["KL"] == {}


def test_the_table_has_a_row_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert heldout_table({"a": ROWS}).splitlines()[:3] == [
        "eval/heldout/reward after rollout | 0 | 2",
        "---|---|---",
        "a | 0.00 | 0.75",
    ]
    files = []
    for name in ("seed1", "seed2"):
        path = tmp_path / name / "metrics.jsonl"
        path.parent.mkdir()
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        files.append(str(path))
    image = tmp_path / "docs" / "curve.png"  # a folder that does not exist yet
    assert main([*files, "--table", "-o", str(image)]) == 0
    printed = capsys.readouterr().out
    assert "seed1 | 0.00 | 0.75" in printed and "seed2 | 0.00 | 0.75" in printed
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
