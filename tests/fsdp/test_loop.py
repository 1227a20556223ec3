"""The core loop driving FSDPBackend: PPO with a critic and a KL reference, saved and resumed (a
run stopped after 2 rollouts and resumed from its checkpoint ends with the same actor and critic
weights, bit for bit, as an uninterrupted run of 4: model, AdamW state, LR schedule), and an
on-policy distillation teacher built as an eval stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlcore.config import structure_config
from rlcore.loop import RunData, run
from rlcore.loop.plan import plan
from rlcore.samples import EvalSet, Prompt
from rlcore.testing import RecordingSink, ScriptedEngine, label_reward
from rlcore.testing.tiny import build_tiny_llama
from rlcore_fsdp.backend import FSDPBackend
from tests.megatron.helpers import TINY, RecordingBackend, sent_weights

pytestmark = pytest.mark.slow

PROMPTS = tuple(
    Prompt(index=i, text=f"{i}+1=", token_ids=(1, i + 3), label=str(i + 1)) for i in range(6)
)
DATA = RunData(train_prompts=PROMPTS, eval_sets=(EvalSet("heldout", PROMPTS[:2]),), seed=3)


@pytest.fixture(scope="module")
def char_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ScriptedEngine emits characters' code points as tokens: a 128-token vocabulary holds them."""
    folder = tmp_path_factory.mktemp("char_llama")
    build_tiny_llama(folder, **{**TINY, "vocab_size": 128})
    return folder


def _plan(hf: Path, save: Path, num_rollout: int, load: Path | None = None) -> Any:
    data: dict[str, Any] = {
        "model": {"hf_checkpoint": str(hf), "train_backend": "fsdp"},
        "rollout": {"num_rollout": num_rollout, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "algorithm": {"advantage_estimator": "ppo", "use_kl_loss": True, "kl_loss_coef": 0.01},
        "optim": {
            "lr": 1e-3,
            "lr_warmup_iters": 1,
            "lr_decay_iters": 8,
            "lr_decay_style": "cosine",
        },
        "train": {"global_batch_size": 2, "micro_batch_size": 1},
        "checkpoint": {"save": str(save), "save_interval": 2},
        "eval": {"interval": 2, "prompt_data": [{"name": "heldout", "path": "unused"}]},
    }
    if load is not None:
        data["checkpoint"]["load"] = str(load)
    return plan(structure_config(data))


def test_stopped_and_resumed_run_equals_an_uninterrupted_one(
    char_llama: Path, tmp_path: Path
) -> None:
    straight = RecordingBackend(FSDPBackend())
    result = run(
        _plan(char_llama, tmp_path / "a", 4), straight, ScriptedEngine(), label_reward, DATA
    )
    assert result.trained == (0, 1, 2, 3)
    assert sorted(straight.training) == ["actor", "critic"]
    assert {"train/actor/kl_loss", "train/critic/value_loss"} <= set(result.last_train)

    first = run(
        _plan(char_llama, tmp_path / "b", 2),
        RecordingBackend(FSDPBackend()),
        ScriptedEngine(),
        label_reward,
        DATA,
    )
    assert first.saved == (1,)
    resumed = RecordingBackend(FSDPBackend())
    second = run(
        _plan(char_llama, tmp_path / "b", 4, load=tmp_path / "b"), resumed, ScriptedEngine(),
        label_reward, DATA,
    )  # fmt: skip
    assert second.trained == (2, 3)
    for role in ("actor", "critic"):
        a = sent_weights(straight.training[role])
        b = sent_weights(resumed.training[role])
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"{role}: {name}"


def test_a_teacher_is_an_eval_stack_whose_reverse_kl_reaches_the_advantages(
    char_llama: Path,
) -> None:
    """``--use-opd`` with FSDP: the teacher is built as an eval stack (no optimizer) and scores
    every rollout; against the student's own start the reverse KL is 0, one step later not."""
    data: dict[str, Any] = {
        "model": {"hf_checkpoint": str(char_llama), "train_backend": "fsdp"},
        "rollout": {"num_rollout": 2, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "optim": {"lr": 1e-3},
        "train": {"global_batch_size": 4, "micro_batch_size": 2},
        "opd": {"use_opd": True, "opd_teacher_hf_checkpoint": str(char_llama)},
    }
    backend, sink = RecordingBackend(FSDPBackend()), RecordingSink()
    result = run(plan(structure_config(data)), backend, ScriptedEngine(), label_reward, DATA, sink)
    assert result.built == ("train:actor", "eval:teacher")
    (teacher,) = backend.eval_stacks
    assert teacher.spec.role == "teacher" and not hasattr(teacher, "optimizer")
    kl = [m["opd/kl_mean"] for _, m in sink.records if "opd/kl_mean" in m]
    assert len(kl) == 2 and abs(kl[0]) < 1e-5 and abs(kl[1]) > 1e-4
