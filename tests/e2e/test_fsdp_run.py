"""``--train-backend fsdp`` through the launcher as a user runs it (``python -m rlcore.launch``,
its own Ray start-up): two GRPO rollouts of the tiny demo with a checkpoint and an HF export,
then an eval-only run on the checkpoint that builds the actor's eval stack and nothing else. (The
entropy bonus makes the update nonzero when no sample of the two rollouts is rewarded.) PPO with
LoRA and a KL loss: the actor and the critic train adapters, and the reference runs in the actor's
ranks (the placement reserves no slots for it). What the backend cannot do is refused before
anything starts: a tensor-parallel split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch.distributed.checkpoint.filesystem import FileSystemReader

from rlcore_fsdp.lora import PREFIX, is_adapter

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _launch(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlcore.launch", "--train-backend", "fsdp", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _summary(out: Path) -> dict[str, object]:
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    return summary


def test_fsdp_trains_saves_exports_and_evaluates_the_demo(demo: Path, tmp_path: Path) -> None:
    # fmt: off
    data = [
        "--prompt-data", str(demo / "train.jsonl"), "--input-key", "prompt",
        "--label-key", "answer", "--eval-prompt-data", "heldout", str(demo / "eval.jsonl"),
    ]
    run = _launch(
        "--hf-checkpoint", str(demo / "model"), *data, "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--micro-batch-size", "4",
        "--rollout-max-response-len", "5", "--lr", "1e-3", "--seed", "7", "--num-rollout", "2",
        "--skip-eval-before-train", "--entropy-coef", "0.01", "--save", str(tmp_path / "ckpt"),
        "--save-hf", str(tmp_path / "hf"), "--output-dir", str(tmp_path / "train"),
    )
    # fmt: on
    assert run.returncode == 0, run.stderr[-3000:]
    summary = _summary(tmp_path / "train")
    assert summary["built"] == ["train:actor"] and summary["trained"] == [1, 2]

    exported = tmp_path / "hf" / "rollout_000002"
    trained = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    initial = transformers.AutoModelForCausalLM.from_pretrained(demo / "model", dtype=torch.float32)
    before, after = initial.state_dict(), trained.state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[name], after[name]) for name in before)

    evaluated = _launch(
        "--num-rollout", "0", "--load", str(tmp_path / "ckpt"), *data[-3:],
        "--output-dir", str(tmp_path / "eval"),
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    summary = _summary(tmp_path / "eval")
    assert summary["built"] == ["eval:actor"] and summary["trained"] == []


def test_lora_ppo_trains_adapters_on_both_and_the_reference_runs_in_the_actor_s_ranks(
    demo: Path, tmp_path: Path
) -> None:
    """PPO with ``--lora-rank``: the actor and the critic train adapters (the critic its value
    head too), their checkpoints hold those and not the base, and the reference is the actor's
    base in the actor's ranks."""
    # fmt: off
    run = _launch(
        "--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "answer", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--rollout-max-response-len", "4", "--lr", "1e-3", "--num-rollout", "2",
        "--lora-rank", "4", "--use-kl-loss", "--kl-loss-coef", "0.1",
        "--advantage-estimator", "ppo", "--save", str(tmp_path / "ckpt"),
        "--output-dir", str(tmp_path / "out"),
    )
    # fmt: on
    assert run.returncode == 0, run.stderr[-3000:]
    summary = _summary(tmp_path / "out")
    assert summary["built"] == ["train:actor", "train:critic", "eval:reference"], summary
    assert summary["trained"] == [1, 2]
    log = (tmp_path / "out" / "run.log").read_text()
    placed = log.split("placement:", 1)[1].split(" INFO ", 1)[0]
    assert "actor: 1 rank(s)" in placed and "reference" not in placed, placed
    rows = [
        json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    critic = [row["train/critic/grad_norm"] for row in rows if "train/critic/loss" in row]
    assert len(critic) == 2 and all(norm > 0 for norm in critic), rows
    saved = tmp_path / "ckpt" / "rollout_000002"
    for role, head in (("actor", set()), ("critic", {"score.weight", "score.bias"})):
        held = FileSystemReader(saved / role / "model").read_metadata().state_dict_metadata
        plain = {n for n in held if not is_adapter(n)}
        assert {n.removeprefix(PREFIX) for n in plain} == head, (role, held)  # not the base


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        pytest.param(
            ["--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2"],
            ["the fsdp backend shards models over data-parallel ranks only",
             "--train-backend megatron"],
            id="a tensor-parallel split",
        ),
    ],
)  # fmt: skip
def test_what_fsdp_cannot_do_is_refused_before_anything_starts(
    demo: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    said: list[str],
) -> None:
    from rlcore.launch.cli import main

    # fmt: off
    base = [
        "--train-backend", "fsdp", "--hf-checkpoint", str(demo / "model"),
        "--prompt-data", str(demo / "train.jsonl"), "--input-key", "prompt",
        "--label-key", "answer", "--num-rollout", "2", "--output-dir", str(tmp_path / "out"),
    ]
    # fmt: on
    assert main([*base, *flags]) == 2
    err = capsys.readouterr().err
    for words in said:
        assert words in err, err
    assert "ray: started" not in err and not (tmp_path / "out").exists()
