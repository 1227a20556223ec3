"""The README's "Your own task" section, run as a new user runs it (``tests/readme_task.py``):
a model made with ``python -m rlcore.new_model``, prompts, a reward module, a training run with a
warm start, GRPO, a checkpoint and a Hugging Face export (4 rollouts here, 160 in the README), an
eval-only run of the export that scores as the training run's last evaluation, and the export
loaded by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.loop.metrics import read_jsonl_metrics
from tests.readme_task import SHORT, run, shortened, steps, train_step

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]


def _last_eval(metrics: Path) -> dict[str, float]:
    return [r for r in read_jsonl_metrics(metrics) if "eval/heldout/reward" in r][-1]


def test_the_readme_takes_a_task_of_ones_own_to_an_evaluated_export(tmp_path: Path) -> None:
    all_steps = steps()
    train = train_step(all_steps)
    assert [s.language for s in all_steps].count("bash") == 3
    outputs = [
        run(shortened(step, SHORT) if step == train else step, tmp_path, timeout_s=900)
        for step in all_steps
    ]
    sort = tmp_path / "sort"

    trained = json.loads((sort / "run" / "summary.json").read_text())
    assert trained["status"] == "ok"
    exports = sorted((sort / "export").glob("rollout_*"))
    assert len(exports) == 2  # after rollout 2 (--save-interval) and after the last
    assert (sort / "ckpt" / "latest").exists()
    evaluated = json.loads((sort / "eval" / "summary.json").read_text())
    assert evaluated["status"] == "ok"
    # The export, evaluated on its own, scores as the training run's last evaluation did.
    last = _last_eval(sort / "run" / "metrics.jsonl")
    again = _last_eval(sort / "eval" / "metrics.jsonl")
    for key in ("eval/heldout/reward", "eval/heldout/pass@1"):
        assert again[key] == pytest.approx(last[key], abs=1e-9), key
    assert "done: trained nothing (eval-only)" in outputs[-2].stderr
    # transformers loads it and answers with the letters it knows
    answer = outputs[-1].stdout.strip()
    assert answer and set(answer) <= set("abcdefgh>"), answer
