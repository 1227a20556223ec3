"""The model families that only the FSDP backend builds train through the launcher: for each (a
tiny random model from its transformers config class, :data:`tests.fsdp.test_families.CONFIGS`,
with a character tokenizer), one GRPO rollout with ``--train-backend fsdp`` takes one train step
that moves the weights, and its ``--save-hf`` export loads in transformers. In process
(``rlcore.launch.cli.execute``, what the command line calls) on the session's Ray instance, so
each family costs its run and not a Ray start; ``tests/e2e/test_fsdp_run.py`` runs the command
line itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from rlcore.config.flags import load_config
from rlcore.launch.cli import execute
from rlcore.loop.metrics import read_jsonl_metrics
from rlcore.new_model import build_char_tokenizer, write_model
from tests.fsdp.test_families import CONFIGS

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ALPHABET = "0123456789>"
"""The characters of the prompts and answers: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2 (the
configs' special ids) and 11 more, within every config's vocabulary of 40."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two training prompts of the demo's task (reverse three digits)."""
    folder = tmp_path_factory.mktemp("data")
    rows = [{"prompt": f"{n:03d}>", "answer": f"{n:03d}"[::-1]} for n in (123, 456)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _state(folder: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return dict(model.state_dict())


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_one_grpo_rollout_trains(
    family: str, data: Path, tmp_path: Path, ray_cluster: None
) -> None:
    model = tmp_path / "model"
    write_model(model, CONFIGS[family]().to_dict(), seed=3)
    build_char_tokenizer(model, ALPHABET)
    # fmt: off
    config = load_config([
        "--train-backend", "fsdp", "--hf-checkpoint", str(model),
        "--prompt-data", str(data / "train.jsonl"), "--input-key", "prompt",
        "--label-key", "answer", "--num-rollout", "1", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "4",
        "--rollout-max-response-len", "3", "--lr", "1e-3", "--seed", "7",
        # the entropy bonus moves the weights when no sample is rewarded (advantages all 0)
        "--entropy-coef", "0.01", "--save-hf", str(tmp_path / "hf"),
        "--output-dir", str(tmp_path / "out"),
    ])
    # fmt: on
    result = execute(config)
    assert (result.trained, result.built) == ((0,), ("train:actor",))
    rows = read_jsonl_metrics(tmp_path / "out" / "metrics.jsonl")
    (row,) = [r for r in rows if "train/actor/loss" in r]
    assert row["train/actor/grad_norm"] > 0
    # the engine (transformers) and the actor hold the same weights before the step
    assert row["train/actor/logprob_mismatch"] < 1e-3
    (exported,) = (tmp_path / "hf").iterdir()
    before, after = _state(model), _state(exported)
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[name], after[name]) for name in before)
