"""LoRA's reference through the Ray launcher: the backend kind says the reference views the actor's
model (:attr:`rlcore.backends.BackendKind.model_owner`), so :class:`RayBackend` builds it in the
actor's rank actors (same processes, no slots of its own) as the actor's base with the adapters
disabled; closing it leaves the actor running. A GRPO run with a KL loss against it trains, and
stopped and resumed it ends with the same weights as an uninterrupted run."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from rlcore.config import structure_config
from rlcore.config.flags import load_config
from rlcore.launch.prepare import placement_request
from rlcore.launch.ray.ranks import GroupOptions, RayGroupError
from rlcore.launch.ray.stacks import RayBackend, RayEvalStack, RayTrainingStack
from rlcore.launch.ray.worker import RankContext
from rlcore.loop import run
from rlcore.loop.plan import plan
from rlcore.protocols.stacks import ModelStack
from rlcore.specs import EvalSpec
from rlcore.testing import RecordingSink, ScriptedEngine, label_reward
from rlcore_fsdp.kind import FSDP, FSDPRuntime
from rlcore_fsdp.options import FSDPOptions
from tests.conformance.test_loop_contract import DATA, char_llama  # noqa: F401  # a fixture
from tests.fsdp.test_lora import _log_probs, llama  # noqa: F401  # llama: a fixture
from tests.megatron.helpers import (
    TINY,
    RecordingBackend,
    make_batch,
    make_samples,
    sent_weights,
    train_spec,
)

pytest_plugins = ["tests.conftest_ray"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

LORA = FSDPOptions(lora_rank=4, lora_alpha=8)
OPTIONS = GroupOptions(setup_timeout_s=300)


def _backend() -> RayBackend:
    owner = functools.partial(FSDP.owner_of, LORA)
    return RayBackend(FSDPRuntime(LORA), options=OPTIONS, model_owner=owner)


def _pid(context: RankContext[ModelStack]) -> int:
    return os.getpid()


def test_the_lora_reference_gets_no_slots_of_its_own() -> None:
    flags = [
        "--train-backend", "fsdp", "--hf-checkpoint", "m", "--num-rollout", "1",
        "--use-kl-loss", "--kl-loss-coef", "0.01",
    ]  # fmt: skip
    for lora, reserved in ((["--lora-rank", "4"], False), ([], True)):
        config = load_config(flags + lora)
        assert placement_request(config, plan(config)).reference is reserved


def test_the_reference_runs_in_the_actor_s_rank_actors(
    ray_cluster: None,
    llama: Path,  # noqa: F811  # the fixture imported above
) -> None:
    from transformers import AutoModelForCausalLM

    samples = make_samples(4, seed=11)
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    want = _log_probs(base, samples, TINY["vocab_size"])
    with _backend() as backend:
        actor = backend.build_training_stack(train_spec(llama))
        reference = backend.build_eval_stack(EvalSpec(train_spec(llama, "reference").model))
        pids = [node.pid for node in actor.group.nodes]
        assert reference.group.actors == actor.group.actors
        assert reference.group.run_on_all_ranks(_pid) == pids  # the stack is in those processes
        actor.train_step(make_batch(samples, seed=1, rollout=True))
        for got, expected in zip(reference.forward(samples), want, strict=True):
            assert got == pytest.approx(expected, abs=1e-5)
        moved = actor.forward(samples)

        reference.close()
        assert actor.group.run_on_all_ranks(_pid) == pids
        assert actor.forward(samples) == moved  # the actor's model is untouched
        with pytest.raises(RayGroupError, match="closed"):
            reference.forward(samples)


def _plan(hf: Path, save: Path, num_rollout: int, load: Path | None = None) -> Any:
    data: dict[str, Any] = {
        "model": {"hf_checkpoint": str(hf), "train_backend": "fsdp"},
        "rollout": {"num_rollout": num_rollout, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "algorithm": {"advantage_estimator": "grpo", "use_kl_loss": True, "kl_loss_coef": 0.1},
        "optim": {"lr": 1e-2},
        "train": {"global_batch_size": 4, "micro_batch_size": 2},
        "checkpoint": {"save": str(save), "save_interval": 1},
    }
    if load is not None:
        data["checkpoint"]["load"] = str(load)
    return plan(structure_config(data))


def test_a_kl_run_with_lora_through_ray_trains_and_resumes_exactly(
    ray_cluster: None,
    char_llama: Path,  # noqa: F811  # the fixture imported above
    tmp_path: Path,
) -> None:
    sink = RecordingSink()
    with _backend() as ray_backend:
        backend = RecordingBackend(ray_backend)
        straight = run(
            _plan(char_llama, tmp_path / "a", 2), backend, ScriptedEngine(), label_reward, DATA,
            sink,
        )  # fmt: skip
        assert straight.built == ("train:actor", "eval:reference")
        (reference,) = backend.eval_stacks
        assert isinstance(reference, RayEvalStack)
        assert (
            reference.group.actors == cast(RayTrainingStack, backend.training["actor"]).group.actors
        )
        expected = sent_weights(backend.training["actor"])
    # the reference did not move with the adapters: no KL before the first step, some after
    kl = [m["train/actor/kl_loss"] for _, m in sink.records if "train/actor/kl_loss" in m]
    assert len(kl) == 2 and kl[0] == pytest.approx(0.0, abs=1e-6) and abs(kl[1]) > 1e-6

    with _backend() as ray_backend:
        first = run(
            _plan(char_llama, tmp_path / "b", 1), ray_backend, ScriptedEngine(), label_reward, DATA
        )
        assert first.saved == (0,)
    with _backend() as ray_backend:
        backend = RecordingBackend(ray_backend)
        resumed = run(
            _plan(char_llama, tmp_path / "b", 2, load=tmp_path / "b"), backend, ScriptedEngine(),
            label_reward, DATA,
        )  # fmt: skip
        assert resumed.trained == (1,)
        got = sent_weights(backend.training["actor"])
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
