"""Multi-turn GRPO with a real SGLang server on the CPU: the tool demo's calculator episodes,
each turn sent to ``/generate`` as the conversation's ``input_ids`` (token-in/token-out), the
turns of concurrent episodes in one engine call per step; then eval-only on the multi-turn eval
set from the saved checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.launch.tool_demo import prepare_tool_demo

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

DEMO = "rlcore.launch.tool_demo"


def _run(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlcore_megatron.run", *flags],
        capture_output=True,
        text=True,
        timeout=1500,
    )


def test_multiturn_grpo_then_eval_only_with_sglang(tmp_path: Path) -> None:
    demo = tmp_path / "demo"
    prepare_tool_demo(demo, train_size=32, heldout=4)
    common = [
        *("--hf-checkpoint", str(demo / "model"), "--input-key", "prompt", "--label-key", "label"),
        *("--eval-prompt-data", "heldout", str(demo / "eval.jsonl")),
        *("--custom-rm-path", f"{DEMO}:final_answer_reward"),
        *("--environment-path", f"{DEMO}:calculator", "--max-turns", "3"),
        *("--rollout-max-response-len", "40", "--rollout-engine", "sglang"),
    ]
    train = _run(
        *common,
        *("--prompt-data", str(demo / "train.jsonl")),
        *("--num-rollout", "3", "--sft-warmup-rollouts", "1"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--global-batch-size", "4", "--micro-batch-size", "4", "--lr", "1e-3"),
        *("--save", str(tmp_path / "ckpt"), "--skip-eval-before-train"),
        *("--output-dir", str(tmp_path / "train")),
    )
    assert train.returncode == 0, train.stderr[-3000:]
    summary = json.loads((tmp_path / "train" / "summary.json").read_text())
    assert summary["trained"] == [1, 2, 3]
    rows = [json.loads(x) for x in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/turns" in r]
    assert len(steps) == 2
    # SGLang's log-probs of the model's tokens, sampled from the conversation's ids, agree with
    # Megatron's recomputation over the same ids (observations included).
    assert all(r["train/actor/logprob_mismatch"] < 1e-3 for r in steps)

    evaluate = _run(
        *common,
        *("--num-rollout", "0", "--load", str(tmp_path / "ckpt")),
        *("--output-dir", str(tmp_path / "eval")),
    )
    assert evaluate.returncode == 0, evaluate.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["built"] == ["eval:actor"]
    assert "eval/heldout/reward" in summary["last_eval"]
