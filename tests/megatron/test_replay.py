"""The rollout seam with the Megatron backend on a tiny model: GRPO with dynamic sampling (a
filter, over-sampling, kept surplus) and TIS. A replay of the run's saved rollouts, without any
engine, reproduces its weights bit for bit, twice; and a run resumed from its mid-run checkpoint
(carried groups and prompt position included) ends with the same weights as the uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, final

import pytest
import torch

from rlcore.config import structure_config
from rlcore.loop import RunData, run
from rlcore.loop.plan import Plan, plan
from rlcore.protocols.stacks import EvalStack, TrainingStack
from rlcore.samples import Prompt
from rlcore.specs import EvalSpec, TrainSpec
from rlcore.testing import RecordingSink, ScriptedEngine, label_reward
from rlcore.testing.tiny import build_tiny_llama
from rlcore_megatron.backend import MegatronBackend
from tests.megatron.helpers import TINY, sent_weights

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

PROMPTS = tuple(
    Prompt(index=i, text=f"{i}+1=", token_ids=(1, i + 3), label=str(i + 1)) for i in range(9)
)
DATA = RunData(train_prompts=PROMPTS, seed=3)


def every_third_always_right(prompt: Prompt, i: int) -> str:
    """Prompts 0, 3, 6: every sample right (filtered out); the others alternate right/wrong."""
    return prompt.label if prompt.index % 3 == 0 or i % 2 == 0 else prompt.label + "?"


@final
class RecordingBackend:
    """MegatronBackend that keeps the actor it built, so the test can read its weights."""

    def __init__(self) -> None:
        self.inner = MegatronBackend()
        self.actor: TrainingStack | None = None

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack:
        self.actor = self.inner.build_training_stack(spec)
        return self.actor

    def build_eval_stack(self, spec: EvalSpec) -> EvalStack:
        return self.inner.build_eval_stack(spec)

    def weights(self) -> dict[str, torch.Tensor]:
        assert self.actor is not None
        return sent_weights(self.actor)


@pytest.fixture(scope="module")
def char_llama(tmp_path_factory: pytest.TempPathFactory, megatron_rank: None) -> Path:
    """ScriptedEngine emits characters' code points as tokens: a 128-token vocabulary holds them."""
    folder = tmp_path_factory.mktemp("char_llama")
    build_tiny_llama(folder, **{**TINY, "vocab_size": 128})
    return folder


def _plan(hf: Path, tmp: Path, **debug: Any) -> Plan:
    data: dict[str, Any] = {
        "model": {"hf_checkpoint": str(hf)},
        "rollout": {
            "num_rollout": 4,
            "rollout_batch_size": 2,
            "n_samples_per_prompt": 2,
            "over_sampling_batch_size": 4,
            "over_sampling_surplus": "keep",
            "dynamic_sampling_filter_path": "rlcore.rollout:check_reward_nonzero_std",
        },
        "algorithm": {"use_tis": True, "tis_clip_low": 0.5, "loss_agg_mode": "token-mean"},
        "optim": {"lr": 1e-3},
        "train": {"global_batch_size": 2, "micro_batch_size": 1},
        "checkpoint": {"save": str(tmp / "ckpt"), "save_interval": 2},
        "debug": debug,
    }
    load = debug.pop("load", None)
    if load is not None:
        data["checkpoint"]["load"] = str(load)
    return plan(structure_config(data))


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_replays_and_a_resume_reproduce_the_run_bit_for_bit(
    char_llama: Path, tmp_path: Path
) -> None:
    rollouts = str(tmp_path / "rollouts")
    original, sink = RecordingBackend(), RecordingSink()
    engine = ScriptedEngine(every_third_always_right)
    result = run(
        _plan(char_llama, tmp_path / "a", save_debug_rollout_data=rollouts),
        original,
        engine,
        label_reward,
        DATA,
        sink,
    )
    assert result.trained == (0, 1, 2, 3) and result.saved == (1, 3)
    rows = [m for _, m in sink.records]
    assert sum(m["rollout/groups_filtered"] for m in rows) > 0
    assert sum(m["rollout/groups_carried"] for m in rows) > 0
    assert all(0 < m["train/actor/tis_weight"] <= 2 for m in rows)
    assert all(m["train/actor/logprob_mismatch"] > 0 for m in rows)  # the script's -1.0 log-probs
    expected = original.weights()

    for attempt in ("b", "c"):  # twice: replaying is deterministic, not just close
        replayed = RecordingBackend()
        replay_plan = _plan(
            char_llama, tmp_path / attempt, load_debug_rollout_data=rollouts, debug_train_only=True
        )
        assert run(replay_plan, replayed, None, label_reward, DATA).trained == (0, 1, 2, 3)
        _equal(replayed.weights(), expected)

    # Resume from the checkpoint after rollout 2 (id 1): its carried groups and prompt position
    # continue the stream exactly where the uninterrupted run was.
    resumed = RecordingBackend()
    middle = tmp_path / "a" / "ckpt" / "rollout_000002"
    assert (middle / "rollout" / "carried.json").is_file()
    second = run(
        _plan(char_llama, tmp_path / "d", load=middle),
        resumed,
        ScriptedEngine(every_third_always_right),
        label_reward,
        DATA,
    )
    assert second.trained == (2, 3)
    _equal(resumed.weights(), expected)
