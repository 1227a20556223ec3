"""Multi-turn GRPO end to end on the CPU with the embedded engine: the tool demo's calculator
environment through the CLI (a warm start on tool-use traces, GRPO on episodes), save, resume,
eval-only on the multi-turn eval set, and a custom generate function (examples/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.checkpoint_files import find_checkpoint, read_meta
from rlcore.config.flags import load_config
from rlcore.launch.cli import execute, main
from rlcore.launch.tool_demo import prepare_tool_demo
from rlcore.loop.metrics import read_jsonl_metrics
from rlcore.rollout.replay import load_rollout_data

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]

DEMO = "rlcore.launch.tool_demo"


@pytest.fixture(scope="module")
def tool_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tool_demo")
    prepare_tool_demo(folder, train_size=64, heldout=4)
    return folder


def _flags(demo: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "train.jsonl")),
        *("--input-key", "prompt", "--label-key", "label"),
        *("--eval-prompt-data", "heldout", str(demo / "eval.jsonl")),
        *("--custom-rm-path", f"{DEMO}:final_answer_reward", "--max-turns", "3"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--global-batch-size", "4", "--micro-batch-size", "2"),
        *("--rollout-max-response-len", "40", "--lr", "1e-3"),
        *("--output-dir", str(out), "--seed", "3"),
        *extra,
    ]


def test_multiturn_grpo_save_resume_then_eval_only(
    tool_demo: Path, tmp_path: Path, ray_cluster: None
) -> None:
    demo = tool_demo
    ckpt, saved = tmp_path / "ckpt", tmp_path / "rollouts"
    first = execute(
        load_config(
            _flags(
                demo,
                tmp_path / "a",
                *("--environment-path", f"{DEMO}:calculator"),
                *("--num-rollout", "3", "--sft-warmup-rollouts", "1"),
                *("--save", str(ckpt), "--eval-interval", "3"),
                *("--save-debug-rollout-data", str(saved)),
            )
        )
    )
    assert first.trained == (0, 1, 2) and first.saved == (2,)
    rows = read_jsonl_metrics(tmp_path / "a" / "metrics.jsonl")
    rl = [r for r in rows if "rollout/reward" in r]
    assert [r["step"] for r in rl] == [2, 3]  # rollout 1 is the warm start
    for r in rl:
        assert r["rollout/turns"] >= 1.0
        # Engine (HF) and trainer (Megatron) log-probs of the model's tokens agree: the trainer
        # scored the very ids each turn was sampled from, observations included.
        assert r["train/actor/logprob_mismatch"] < 1e-3
    for rollout_id in (1, 2):
        samples = [s for g in load_rollout_data(str(saved), rollout_id) for s in g]
        row = next(r for r in rl if r["step"] == rollout_id + 1)  # by number, from 1
        # The loss counted the model's tokens only.
        assert row["train/actor/tokens"] == sum(s.response.model_tokens for s in samples)
        for s in samples:
            assert s.response.loss_mask and s.response.turns
            assert s.response.token_ids == tuple(i for t in s.response.turns for i in t.token_ids)
            assert len(s.response.token_ids) <= 40
    assert "eval/heldout/reward" in rows[-1]

    resumed = execute(
        load_config(
            _flags(
                demo,
                tmp_path / "b",
                *("--environment-path", f"{DEMO}:calculator"),
                *("--num-rollout", "4", "--sft-warmup-rollouts", "1"),
                *("--load", str(ckpt), "--save", str(ckpt)),
            )
        )
    )
    assert resumed.trained == (3,)
    assert read_meta(find_checkpoint(ckpt)).rollout_id == 3

    # Eval-only on the multi-turn eval set, with the tool refused: the episodes still run.
    code = main(
        [
            *("--num-rollout", "0", "--eval-interval", "1", "--load", str(ckpt)),
            *("--hf-checkpoint", str(demo / "model")),
            *("--input-key", "prompt", "--label-key", "label"),
            *("--eval-prompt-data", "heldout", str(demo / "eval.jsonl")),
            *("--custom-rm-path", f"{DEMO}:final_answer_reward"),
            *("--environment-path", f"{DEMO}:no_calculator", "--max-turns", "2"),
            *("--rollout-max-response-len", "40", "--output-dir", str(tmp_path / "c")),
        ]
    )
    assert code == 0
    rows = read_jsonl_metrics(tmp_path / "c" / "metrics.jsonl")
    assert {"eval/heldout/reward", "eval/heldout/response_len"} <= set(rows[0])


@pytest.mark.parametrize("backend", ["megatron", "fsdp"])
def test_custom_generate_function_from_examples(
    tool_demo: Path, tmp_path: Path, ray_cluster: None, backend: str
) -> None:
    """Episodes from a custom generate function, trained by each backend: it scores the very ids
    each turn was sampled from, observations included (the engine's log-probs)."""
    demo = tool_demo
    result = execute(
        load_config(
            _flags(
                demo,
                tmp_path / "a",
                *("--custom-generate-function-path", "examples.multiturn_generate:generate"),
                *("--num-rollout", "2", "--sft-warmup-rollouts", "1", "--env-reward", "add"),
                *("--train-backend", backend),
            )
        )
    )
    assert result.trained == (0, 1)
    rows = [r for r in read_jsonl_metrics(tmp_path / "a" / "metrics.jsonl") if "rollout/turns" in r]
    assert len(rows) == 1 and rows[0]["train/actor/logprob_mismatch"] < 1e-3


def test_the_readme_task_from_scratch_runs(tmp_path: Path) -> None:
    """``python examples/multiturn_task.py FOLDER``, as the README's "your own multi-turn task"
    says: it builds its model, trains two rollouts and saves them; each saved episode alternates
    model turns and observations, observations carry no <bos> and loss mask 0, and the reward
    is the example's own."""
    import importlib.util
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "multiturn_task", root / "examples" / "multiturn_task.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    done = subprocess.run(
        [sys.executable, str(root / "examples" / "multiturn_task.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "  model " in done.stdout and "loss mask" in done.stdout
    groups = load_rollout_data(str(tmp_path / "rollouts"), 1)
    samples = [s for group in groups for s in group]
    assert len(samples) == 16
    bos = 1
    for sample in samples:
        response, turns = sample.response, sample.response.turns
        assert [t.role for t in turns] == ["model", "environment"] * (len(turns) // 2) + [
            "model"
        ] * (len(turns) % 2)
        mask = [m for t in turns for m in [int(t.role == "model")] * len(t.token_ids)]
        assert list(response.loss_mask) == mask
        assert list(response.token_ids) == [i for t in turns for i in t.token_ids]
        for turn in turns:
            if turn.role == "environment":
                assert bos not in turn.token_ids and turn.text in ("<", ">")
        assert sample.reward == example.reward(sample.prompt, response)
        assert sample.prompt.text == "?" and sample.prompt.label in example.ALPHABET
