"""The core loop over each backend of :data:`~tests.conformance.candidates.CANDIDATES` that builds
its models from Hugging Face folders: PPO with a critic and a KL reference stopped after 2
rollouts and resumed from its checkpoint ends with the same actor and critic weights, bit for
bit, as an uninterrupted run of 4 (model, optimizer state, LR schedule); an on-policy
distillation teacher is an eval stack whose reverse KL reaches the advantages; micro-batches cut
by a token budget give a rollout the metrics of micro-batches cut by sample count."""

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
from tests.conformance.candidates import CANDIDATES
from tests.conformance.conftest import Under
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


def _ppo_plan(
    under: Under, hf: Path, save: Path, num_rollout: int, load: Path | None = None
) -> Any:
    data: dict[str, Any] = {
        # The candidates that read models are named as their backends are.
        "model": {"hf_checkpoint": str(hf), "train_backend": under.name},
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


def _backend(under: Under) -> RecordingBackend:
    """A fresh backend of ``under``'s kind, recording what it builds."""
    return RecordingBackend(CANDIDATES[under.name].backend())


def test_a_stopped_and_resumed_run_equals_an_uninterrupted_one(
    model_reader: Under, char_llama: Path, tmp_path: Path
) -> None:
    straight = _backend(model_reader)
    result = run(
        _ppo_plan(model_reader, char_llama, tmp_path / "a", 4),
        straight,
        ScriptedEngine(),
        label_reward,
        DATA,
    )
    assert result.trained == (0, 1, 2, 3)
    assert sorted(straight.training) == ["actor", "critic"]
    assert {"train/actor/kl_loss", "train/critic/value_loss"} <= set(result.last_train)

    first = run(
        _ppo_plan(model_reader, char_llama, tmp_path / "b", 2),
        _backend(model_reader),
        ScriptedEngine(),
        label_reward,
        DATA,
    )
    assert first.saved == (1,)
    resumed = _backend(model_reader)
    second = run(
        _ppo_plan(model_reader, char_llama, tmp_path / "b", 4, load=tmp_path / "b"),
        resumed,
        ScriptedEngine(),
        label_reward,
        DATA,
    )
    assert second.trained == (2, 3)

    for role in ("actor", "critic"):
        a = sent_weights(straight.training[role])
        b = sent_weights(resumed.training[role])
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"{role}: {name}"


def test_a_teacher_is_an_eval_stack_whose_reverse_kl_reaches_the_advantages(
    model_reader: Under, char_llama: Path, tmp_path: Path
) -> None:
    """``--use-opd``: the teacher is built as an eval stack (no optimizer) and scores every
    rollout; the reverse KL is 0 against a teacher that is the student's own start (one step
    later it is not), and not 0 against another model."""
    other = tmp_path / "other"
    build_tiny_llama(other, **{**TINY, "vocab_size": 128}, seed=7)

    def distill(teacher: Path) -> tuple[list[float], RecordingBackend]:
        data: dict[str, Any] = {
            "model": {"hf_checkpoint": str(char_llama), "train_backend": model_reader.name},
            "rollout": {"num_rollout": 2, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
            "optim": {"lr": 1e-3},
            "train": {"global_batch_size": 4, "micro_batch_size": 2},
            "opd": {"use_opd": True, "opd_teacher_hf_checkpoint": str(teacher)},
        }
        backend, sink = _backend(model_reader), RecordingSink()
        result = run(
            plan(structure_config(data)), backend, ScriptedEngine(), label_reward, DATA, sink
        )
        assert result.built == ("train:actor", "eval:teacher")
        return [m["opd/kl_mean"] for _, m in sink.records if "opd/kl_mean" in m], backend

    same, backend = distill(char_llama)
    (teacher,) = backend.eval_stacks
    assert teacher.spec.role == "teacher" and not hasattr(teacher, "optimizer")
    assert len(same) == 2 and abs(same[0]) < 1e-5  # rollout 0: the student is still the teacher
    assert abs(same[1]) > 1e-4  # one step later it is not
    different, _ = distill(other)
    assert abs(different[0]) > 1e-3


def test_a_token_budget_run_scores_and_trains_as_a_padded_one(
    model_reader: Under, char_llama: Path
) -> None:
    """``--use-dynamic-batch-size`` through the loop: the actor's old log-probs, the reference's,
    the critic's values, the teacher's scores and both train steps, cut by a budget of 8 padded
    tokens, give the rollout's metrics of micro-batches by sample count."""

    def one_rollout(budget: dict[str, Any]) -> dict[str, float]:
        data: dict[str, Any] = {
            "model": {"hf_checkpoint": str(char_llama), "train_backend": model_reader.name},
            "rollout": {"num_rollout": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
            "algorithm": {
                "advantage_estimator": "ppo",
                "kl_coef": 0.01,
                "use_kl_loss": True,
                "kl_loss_coef": 0.01,
            },
            "optim": {"lr": 1e-3},
            "train": {"global_batch_size": 4, "micro_batch_size": 2, **budget},
            "opd": {"use_opd": True, "opd_teacher_hf_checkpoint": str(char_llama)},
        }
        sink = RecordingSink()
        backend = CANDIDATES[model_reader.name].backend()
        run(plan(structure_config(data)), backend, ScriptedEngine(), label_reward, DATA, sink)
        (metrics,) = [m for _, m in sink.records if "train/actor/loss" in m]
        return metrics

    padded = one_rollout({})
    budget = one_rollout({"use_dynamic_batch_size": True, "max_tokens_per_gpu": 8})
    keys = [k for k in padded if not k.startswith("perf/")]
    assert {"train/critic/loss", "train/actor/kl_loss", "opd/kl_mean"} <= set(keys)
    for key in keys:
        assert budget[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    # what the budget saves: padding, reported per train pass beside its throughput
    for role in ("actor", "critic"):
        assert 0 <= budget[f"perf/{role}_train_padding"] < padded[f"perf/{role}_train_padding"]
        assert budget[f"perf/{role}_train_tokens_per_sec"] > 0
    for name in ("actor_logprobs", "ref_logprobs", "critic_values", "teacher_logprobs"):
        assert budget[f"perf/{name}_tokens_per_sec"] > 0
        assert 0 <= budget[f"perf/{name}_padding"] < padded[f"perf/{name}_padding"], name
    assert 0 <= budget["perf/forward_padding"] < padded["perf/forward_padding"]


def test_an_off_policy_run_trains_every_rollout_one_version_behind(
    model_reader: Under, char_llama: Path
) -> None:
    """``--max-staleness 1``: the engine samples rollout j while the backend trains rollout j-1
    (the loop's, whatever the backend); every rollout is trained once, each but the first one
    weight version behind, with decoupled PPO's correction."""
    data: dict[str, Any] = {
        "model": {"hf_checkpoint": str(char_llama), "train_backend": model_reader.name},
        "rollout": {
            "num_rollout": 3,
            "rollout_batch_size": 2,
            "n_samples_per_prompt": 2,
            "max_staleness": 1,
        },
        "optim": {"lr": 1e-3},
        "train": {"global_batch_size": 4, "micro_batch_size": 2},
    }
    sink = RecordingSink()
    result = run(
        plan(structure_config(data)), _backend(model_reader), ScriptedEngine(), label_reward, DATA,
        sink,
    )  # fmt: skip
    assert result.trained == (0, 1, 2)
    staleness = [
        m["rollout/staleness_max"] for _, m in sink.records if "rollout/staleness_max" in m
    ]
    assert staleness == [0.0, 1.0, 1.0]
