"""The core's stack contracts, run against the fake backend and ``MegatronBackend`` alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import attrs
import pytest

import rlcore
from rlcore.errors import BackendContractError, CheckpointError
from rlcore.loop.contracts import build_eval_stack, build_training_stack
from rlcore.protocols import Backend, EvalStack, TrainingStack
from rlcore.samples import EvalSet, Prompt, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore.testing import FakeBackend, RecordingWeightSink, ScriptedEngine, label_reward
from rlcore_megatron.backend import MegatronBackend
from tests.megatron.helpers import make_batch, make_samples, train_spec

pytestmark = pytest.mark.megatron

BACKENDS: dict[str, Callable[[], Backend]] = {"fake": FakeBackend, "megatron": MegatronBackend}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest, megatron_rank: None) -> Backend:
    return BACKENDS[request.param]()


def test_eval_stack_contract(backend: Backend, tiny_hf: Path) -> None:
    spec = EvalSpec(ModelSpec("reference", tiny_hf))
    stack = backend.build_eval_stack(spec)
    assert isinstance(stack, EvalStack)
    assert (
        not hasattr(stack, "optimizer")
        and not hasattr(stack, "scheduler")
        and not hasattr(stack, "train_step")
    )
    assert stack.spec == spec.model
    samples = make_samples(3)
    rows = stack.forward(samples)
    assert [len(r) for r in rows] == [len(s.response.token_ids) for s in samples]
    assert all(isinstance(x, float) for r in rows for x in r)
    sink = RecordingWeightSink()
    stack.send_weights([sink])  # a sink in this process: every stack can feed one
    assert all(isinstance(name, str) for name in sink.names)


def test_training_stack_contract(backend: Backend, tiny_hf: Path, tmp_path: Path) -> None:
    spec = train_spec(tiny_hf, global_batch_size=2, micro_batch_size=1, steps_per_rollout=2)
    stack = backend.build_training_stack(spec)
    assert isinstance(stack, TrainingStack)
    assert stack.spec == spec.model
    assert isinstance(stack.optimizer.state_dict(), Mapping)
    assert isinstance(stack.scheduler.state_dict(), Mapping)
    samples = make_samples(4)
    metrics = stack.train_step(make_batch(samples))
    assert isinstance(metrics, TrainMetrics)
    assert metrics.tokens > 0

    folder = tmp_path / "actor"
    folder.mkdir()
    stack.save(folder, 7)
    fresh = backend.build_training_stack(spec)
    assert fresh.load(folder) == 7
    assert backend.build_eval_stack(EvalSpec(spec.model)).load(folder) == 7
    assert fresh.forward(samples) == stack.forward(samples)


def test_missing_checkpoint_raises_naming_the_path(
    backend: Backend, tiny_hf: Path, tmp_path: Path
) -> None:
    stack = backend.build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
    with pytest.raises(CheckpointError, match=str(tmp_path / "missing")):
        stack.load(tmp_path / "missing")


def test_each_stack_is_of_the_kind_asked_for(backend: Backend, tiny_hf: Path) -> None:
    """What the loop checks at bring-up, on every backend: an eval stack is tagged ``eval`` and
    has no training members, a training stack is tagged ``train``."""
    eval_stack = build_eval_stack(backend, EvalSpec(ModelSpec("actor", tiny_hf)))
    assert eval_stack.kind == "eval"
    spec = train_spec(tiny_hf, global_batch_size=2, micro_batch_size=1)
    assert build_training_stack(backend, spec).kind == "train"


class _HandsOutTrainingStacks:
    """A backend that skips typing and answers ``build_eval_stack`` with a training stack."""

    def __init__(self, inner: Backend, train: TrainSpec) -> None:
        self.inner = inner
        self.train = train

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack:
        return self.inner.build_training_stack(spec)

    def build_eval_stack(self, spec: EvalSpec) -> TrainingStack:
        return self.inner.build_training_stack(attrs.evolve(self.train, model=spec.model))


def test_an_eval_only_run_refuses_a_training_stack_before_evaluating(
    backend: Backend, tiny_hf: Path, tmp_path: Path
) -> None:
    cheat = _HandsOutTrainingStacks(backend, train_spec(tiny_hf, global_batch_size=2))
    (tmp_path / "x.jsonl").touch()
    flags = ["--num-rollout", "0", "--hf-checkpoint", str(tiny_hf)]
    config = rlcore.load_config([*flags, "--eval-prompt-data", "x", str(tmp_path / "x.jsonl")])
    prompts = (Prompt(0, "1+1=", (1, 2), "2"),)
    engine = ScriptedEngine()
    with pytest.raises(BackendContractError) as info:
        rlcore.run(
            rlcore.plan(config),
            cheat,  # type: ignore[arg-type]  # the point: a backend that is not type-checked
            engine,
            label_reward,
            rlcore.RunData(eval_sets=(EvalSet("x", prompts),)),
        )
    message = str(info.value)
    assert "_HandsOutTrainingStacks.build_eval_stack(actor)" in message
    assert "exposes optimizer, scheduler, train_step" in message
    assert engine.calls == [] and engine.updates == []  # nothing was evaluated or pushed
