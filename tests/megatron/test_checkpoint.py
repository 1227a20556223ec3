"""Checkpoints: resume equals an uninterrupted run; missing, half-written and corrupt folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs
import pytest
import torch

from rlcore.errors import CheckpointError
from rlcore.samples import TrainBatch
from rlcore.specs import EvalSpec, LoadSpec, LRSchedule, ModelSpec, Precision
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.checkpoint import read_rollout_id
from rlcore_megatron.stacks import MegatronTrainingStack
from tests.megatron.helpers import (
    make_batch,
    make_samples,
    optimizer_parts,
    train_spec,
    weights,
)

pytestmark = pytest.mark.megatron

SCHEDULE = LRSchedule(lr=2e-3, min_lr=1e-4, warmup_steps=2, decay_steps=6, decay_style="cosine")
ROLLOUTS = 4


def _stack(
    hf: Path, role: str = "actor", precision: Precision = "float32", distributed: bool = False
) -> MegatronTrainingStack:
    spec = train_spec(
        hf,
        "critic" if role == "critic" else "actor",
        global_batch_size=2,
        micro_batch_size=1,
        steps_per_rollout=2,
        schedule=SCHEDULE,
        seed=7,
        precision=precision,
        distributed_optimizer=distributed,
    )
    return MegatronBackend().build_training_stack(spec)


def _optimizer_tensors(stack: MegatronTrainingStack) -> list[torch.Tensor]:
    """What the optimizer steps (the fp32 main weights in bf16, or their shards with the
    distributed optimizer) and its Adam state (moments and step counts)."""
    out: list[torch.Tensor] = []
    for group in stack.optimizer.param_groups:
        for param in group["params"]:
            out.append(param)
    state = [s for part in optimizer_parts(stack.optimizer) for s in part.optimizer.state.values()]
    return out + [s[k] for s in state for k in ("exp_avg", "exp_avg_sq", "step")]


def _batches(role: str) -> list[TrainBatch]:
    return [
        make_batch(make_samples(4, seed=100 + k), seed=200 + k, returns=role == "critic")
        for k in range(ROLLOUTS)
    ]


@pytest.mark.parametrize(
    ("precision", "distributed"),
    [("float32", False), ("bfloat16", False), ("bfloat16", True)],
    ids=["fp32", "bf16", "bf16-distributed-optimizer"],
)
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_resume_ends_with_the_same_weights(
    tiny_hf: Path, tmp_path: Path, role: str, precision: Precision, distributed: bool
) -> None:
    batches = _batches(role)
    straight = _stack(tiny_hf, role, precision, distributed)
    for batch in batches:
        straight.train_step(batch)

    first = _stack(tiny_hf, role, precision, distributed)
    for batch in batches[:2]:
        first.train_step(batch)
    first.save(tmp_path / "ckpt", rollout_id=1)
    del first

    resumed = _stack(tiny_hf, role, precision, distributed)
    assert resumed.load(tmp_path / "ckpt") == 1
    assert resumed.scheduler.num_steps == 4  # 2 rollouts x 2 steps
    for batch in batches[2:]:
        resumed.train_step(batch)

    a, b = weights(straight.export_weights()), weights(resumed.export_weights())
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert straight.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"]
    # Bit for bit below the bf16 weights too: the fp32 main weights and the Adam moments.
    x, y = _optimizer_tensors(straight), _optimizer_tensors(resumed)
    assert len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y, strict=True))


def test_eval_stack_loads_model_weights_from_a_training_checkpoint(
    tiny_hf: Path, tmp_path: Path
) -> None:
    trained = _stack(tiny_hf)
    trained.train_step(_batches("actor")[0])
    trained.save(tmp_path / "ckpt", rollout_id=5)
    ev = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
    assert ev.load(tmp_path / "ckpt") == 5
    samples = make_samples(3, seed=1)
    for x, y in zip(ev.forward(samples), trained.forward(samples), strict=True):
        assert x == pytest.approx(y, abs=1e-6)


def test_save_layout_and_rollout_id_written_last(tiny_hf: Path, tmp_path: Path) -> None:
    stack = _stack(tiny_hf)
    stack.save(tmp_path / "ckpt", rollout_id=3)
    names = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert names == {"model", "optimizer", "scheduler.json", "rollout.json"}
    assert read_rollout_id(tmp_path / "ckpt") == 3


def test_missing_checkpoint_names_the_path(tiny_hf: Path, tmp_path: Path) -> None:
    ev = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
    with pytest.raises(CheckpointError, match=str(tmp_path / "nope")):
        ev.load(tmp_path / "nope")


def test_half_written_and_corrupt_checkpoints_are_refused(tiny_hf: Path, tmp_path: Path) -> None:
    stack = _stack(tiny_hf)
    good = tmp_path / "good"
    stack.save(good, rollout_id=2)

    half = tmp_path / "half"
    shutil.copytree(good, half)
    (half / "rollout.json").unlink()  # a crash before the last write
    with pytest.raises(CheckpointError, match=f"{half}.*incomplete"):
        stack.load(half)

    garbled = tmp_path / "garbled"
    shutil.copytree(good, garbled)
    (garbled / "rollout.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        stack.load(garbled)

    no_model = tmp_path / "no_model"
    shutil.copytree(good, no_model)
    shutil.rmtree(no_model / "model")
    with pytest.raises(CheckpointError, match=str(no_model)):
        stack.load(no_model)

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    for f in (truncated / "model").iterdir():
        if f.suffix == ".distcp":
            f.write_bytes(f.read_bytes()[:64])
    with pytest.raises(CheckpointError, match=str(truncated)):
        stack.load(truncated)


def test_training_stack_refuses_a_weights_only_checkpoint(tiny_hf: Path, tmp_path: Path) -> None:
    stack = _stack(tiny_hf)
    stack.save(tmp_path / "ckpt", rollout_id=0)
    shutil.rmtree(tmp_path / "ckpt" / "optimizer")
    with pytest.raises(CheckpointError, match="optimizer"):
        stack.load(tmp_path / "ckpt")


def test_critic_checkpoint_does_not_load_into_an_actor(tiny_hf: Path, tmp_path: Path) -> None:
    _stack(tiny_hf, "critic").save(tmp_path / "critic", rollout_id=1)
    ev = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
    with pytest.raises(CheckpointError, match=str(tmp_path / "critic")):
        ev.load(tmp_path / "critic")


def test_rollout_json_records_the_format(tiny_hf: Path, tmp_path: Path) -> None:
    _stack(tiny_hf).save(tmp_path / "ckpt", rollout_id=9)
    meta = json.loads((tmp_path / "ckpt" / "rollout.json").read_text())
    assert meta["rollout_id"] == 9 and meta["format"].startswith("rlcore-megatron/")


def test_saving_without_psutil_is_a_clear_error(
    tiny_hf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == "psutil" else real_find_spec(name)

    stack = _stack(tiny_hf)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(CheckpointError, match="psutil"):  # dist_checkpointing would hang instead
        stack.save(tmp_path / "ckpt", rollout_id=0)


def test_an_actor_checkpoint_is_refused_by_a_critic(tiny_hf: Path, tmp_path: Path) -> None:
    _stack(tiny_hf).save(tmp_path / "actor", rollout_id=1)
    critic = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("critic", tiny_hf)))
    with pytest.raises(CheckpointError) as info:
        critic.load(tmp_path / "actor")
    assert str(info.value) == (
        f"checkpoint {tmp_path / 'actor'} holds a different model: head is 'lm' there, 'value' "
        "here (load an actor checkpoint into an actor, a critic's into a critic)"
    )


@pytest.mark.parametrize(
    ("load", "lr", "steps", "adam"),
    [
        (LoadSpec(), 2e-3, 4, True),  # the checkpoint's schedule, step and Adam state
        (LoadSpec(scheduler="flags"), 5e-4, 4, True),  # this spec's values from its step
        (LoadSpec(optimizer=False), 2e-3, 4, False),  # a fresh Adam
        (LoadSpec(optimizer=False, scheduler="fresh"), 5e-4, 0, False),  # --finetune
    ],
    ids=["saved", "override", "no-load-optim", "finetune"],
)
def test_a_resume_restores_what_its_load_spec_says(
    tiny_hf: Path, tmp_path: Path, load: LoadSpec, lr: float, steps: int, adam: bool
) -> None:
    saved = _stack(tiny_hf)
    for batch in _batches("actor")[:2]:
        saved.train_step(batch)
    saved.save(tmp_path / "ckpt", 1)
    other = LRSchedule(lr=5e-4, min_lr=1e-5, warmup_steps=0, decay_steps=20, decay_style="linear")
    spec = train_spec(tiny_hf, global_batch_size=2, micro_batch_size=1, steps_per_rollout=2)
    spec = attrs.evolve(
        spec, optimizer=attrs.evolve(spec.optimizer, schedule=other, adam_beta2=0.95), load=load
    )
    resumed = MegatronBackend().build_training_stack(spec)
    assert resumed.load(tmp_path / "ckpt") == 1
    assert resumed.scheduler.num_steps == steps
    assert resumed.scheduler.max_lr == lr
    # What the next step trains with: this step's point of the schedule load says is in force.
    in_force = SCHEDULE if load.scheduler == "saved" else other
    at = in_force.lr_at(steps)
    assert [group["lr"] for group in resumed.optimizer.param_groups] == pytest.approx(
        [at] * len(resumed.optimizer.param_groups)
    )
    states = [
        s for part in optimizer_parts(resumed.optimizer) for s in part.optimizer.state.values()
    ]
    assert bool(states) == adam
    betas = {group["betas"] for group in resumed.optimizer.param_groups}
    assert betas == ({(0.9, 0.95)} if load.scheduler != "saved" or not adam else {(0.9, 0.999)})
    for name, tensor in weights(saved.export_weights()).items():  # the weights, always
        assert torch.equal(weights(resumed.export_weights())[name], tensor), name
