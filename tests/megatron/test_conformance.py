"""The core's stack contracts, run against the fake backend and ``MegatronBackend`` alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from rlcore.errors import CheckpointError
from rlcore.protocols import Backend, EvalStack, TrainingStack
from rlcore.samples import TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec
from rlcore.testing import FakeBackend, RecordingWeightSink
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
