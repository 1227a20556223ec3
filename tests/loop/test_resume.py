"""A resume is never silent: changed settings are applied, applied only with the anchors' flags,
or refused, and a run never trains at a learning rate of 0 without saying so."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.loop import RunData, run
from rlcore.loop.plan import plan
from rlcore.samples import Prompt
from rlcore.testing import FakeBackend, RecordingSink, ScriptedEngine, label_reward

PROMPTS = tuple(Prompt(index=i, text=f"{i}?", token_ids=(1, i + 3), label=str(i)) for i in range(8))
DATA = RunData(train_prompts=PROMPTS, seed=5)


def _flags(tmp: Path, rollouts: int, *extra: str) -> list[str]:
    return [
        *("--num-rollout", str(rollouts), "--rollout-batch-size", "2"),
        *("--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "1"),
        *("--save", str(tmp / "ckpt"), "--lr", "1e-3"),
        *extra,
    ]


def _train(argv: list[str]) -> tuple[FakeBackend, RecordingSink]:
    backend, sink = FakeBackend(), RecordingSink()
    run(plan(load_config(argv)), backend, ScriptedEngine(), label_reward, DATA, sink)
    return backend, sink


def _lrs(sink: RecordingSink) -> list[float]:
    return [m["train/actor/lr"] for _, m in sink.records if "train/actor/lr" in m]


def _refused(argv: list[str]) -> ConfigError:
    backend = FakeBackend()
    with pytest.raises(ConfigError) as info:
        run(plan(load_config(argv)), backend, ScriptedEngine(), label_reward, DATA)
    assert backend.roles_built == []  # refused before anything was built
    return info.value


def test_a_changed_lr_is_refused_and_applied_with_the_override(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _train(_flags(tmp_path, 2))
    resumed = [*_flags(tmp_path, 4, "--lr", "5e-4"), "--load", str(tmp_path / "ckpt")]
    error = _refused(resumed)
    assert error.paths == ("optim.lr (--lr)",)
    assert "add --override-opt-param-scheduler" in str(error)
    # The same without a change resumes with the checkpoint's schedule, and says nothing changed.
    _, same = _train([*_flags(tmp_path, 3), "--load", str(tmp_path / "ckpt")])
    assert _lrs(same) == [1e-3]
    with caplog.at_level(logging.INFO, logger="rlcore"):
        _, sink = _train([*resumed, "--override-opt-param-scheduler"])
    assert _lrs(sink) == [5e-4]
    assert (
        "changed on resume: optim.lr (--lr): 0.001 -> 0.0005: applied, "
        "--override-opt-param-scheduler: the schedule continues from the checkpoint's step"
    ) in caplog.text


def test_extending_a_decayed_schedule_is_explicit(tmp_path: Path) -> None:
    # 4 rollouts decaying linearly to 0, then resumed to 8 rollouts.
    _, first = _train(_flags(tmp_path, 4, "--lr-decay-style", "linear"))
    assert _lrs(first)[-1] > 0
    longer = [*_flags(tmp_path, 8, "--lr-decay-style", "linear"), "--load", str(tmp_path / "ckpt")]
    error = _refused(longer)
    assert "the LR schedule's decay" in error.paths[0]
    assert "keep decaying over 4 steps: add --override-opt-param-scheduler" in str(error)
    # The override stretches the schedule from the checkpoint's step: no rollout at LR 0.
    _, sink = _train([*longer, "--override-opt-param-scheduler"])
    assert _lrs(sink) == pytest.approx([1e-3 * (1 - s / 8) for s in range(4, 8)])
    # A decay that has ended is refused, not trained at 0.
    from_4 = ["--load", str(tmp_path / "ckpt" / "rollout_000004")]
    ended = [*longer, *from_4, "--override-opt-param-scheduler", "--lr-decay-iters", "5"]
    error = _refused(ended)
    assert error.paths == ("optim.lr_decay_iters (--lr-decay-iters)",)
    assert "steps 6..8 would train at a learning rate of 0" in str(error)


def test_finetune_loads_the_weights_and_starts_afresh(tmp_path: Path) -> None:
    _train(_flags(tmp_path, 3, "--lr-warmup-iters", "1", "--lr-decay-style", "linear"))
    argv = [
        *_flags(tmp_path / "rl", 2, "--lr", "1e-4", "--seed", "9"),
        *("--load", str(tmp_path / "ckpt"), "--finetune"),
    ]
    backend, sink = _train(argv)
    assert [step for step, m in sink.records if "train/actor/lr" in m] == [1, 2]
    actor = backend.training_stacks[0]
    assert actor.optimizer.steps == 2  # a new optimizer: only this run's steps
    assert _lrs(sink) == [1e-4, 1e-4]  # this run's constant schedule from its step 0


def test_finetune_adds_a_critic_the_checkpoint_does_not_have(tmp_path: Path) -> None:
    """Warm start without a critic, then PPO: the actor's weights load, the critic starts from
    its initial weights; a plain resume refuses the new critic before building anything."""
    _train(_flags(tmp_path, 2))
    with_critic = [*_flags(tmp_path / "rl", 3, "--advantage-estimator", "ppo")]
    load = ("--load", str(tmp_path / "ckpt"))
    error = _refused([*with_critic, *load])
    assert "no critic to resume: start from its weights with --finetune" in str(error)
    backend, sink = _train([*with_critic, *load, "--finetune"])
    assert backend.roles_built == ["train:actor", "train:critic"]
    actor, critic = backend.training_stacks
    assert actor.optimizer.steps == critic.optimizer.steps == 3
    assert (tmp_path / "rl" / "ckpt" / "rollout_000003" / "critic").is_dir()


def test_the_seed_and_the_sharding_need_their_flags(tmp_path: Path) -> None:
    _train(_flags(tmp_path, 2))
    load = ["--load", str(tmp_path / "ckpt")]
    error = _refused([*_flags(tmp_path, 4, "--seed", "3"), *load])
    assert error.paths == ("seed (--seed)",) and "add --no-load-rng" in str(error)
    _train([*_flags(tmp_path, 4, "--seed", "3"), *load, "--no-load-rng"])
    problems: Any = [*_flags(tmp_path, 4), *load, "--no-load-optim", "--finetune"]
    with pytest.raises(ConfigError, match=r"\(--finetune\): already starts"):
        load_config(problems)
    with pytest.raises(ConfigError, match="has no effect without --load"):
        load_config(_flags(tmp_path, 4, "--finetune"))


def test_a_checkpoint_that_named_our_dr_grpo_mode_verls_way_resumes_with_the_same_number(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before #34 rlcore called its Dr. GRPO normaliser verl's seq-mean-token-sum-norm, and its
    checkpoints recorded that name. It is read as seq-mean-token-sum-budget, the same number: a
    resume with that name changes nothing, one with another mode says so, and verl's name itself
    is refused (it would mean another number)."""
    dr_grpo = ("--loss-agg-mode", "seq-mean-token-sum-budget")
    _train(_flags(tmp_path, 2, *dr_grpo))
    meta = tmp_path / "ckpt" / "rollout_000002" / "rlcore.json"
    recorded = json.loads(meta.read_text())
    assert recorded["settings"]["algorithm"]["loss_agg_mode"] == "seq-mean-token-sum-budget"
    recorded["settings"]["algorithm"]["loss_agg_mode"] = "seq-mean-token-sum-norm"  # as before
    meta.write_text(json.dumps(recorded))
    load = ("--load", str(meta.parent))  # that checkpoint, whatever a resume saves after it
    with caplog.at_level(logging.INFO, logger="rlcore"):
        _train(_flags(tmp_path, 3, *dr_grpo, *load))
    assert "resuming from" in caplog.text and "loss_agg_mode" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlcore"):
        _train(_flags(tmp_path, 3, "--loss-agg-mode", "token-mean", *load))
    assert (
        "changed on resume: algorithm.loss_agg_mode (--loss-agg-mode): "
        "'seq-mean-token-sum-budget' -> 'token-mean': applied"
    ) in caplog.text
    with pytest.raises(ConfigError, match="use seq-mean-token-sum-budget"):
        load_config(_flags(tmp_path, 3, "--loss-agg-mode", "seq-mean-token-sum-norm", *load))
