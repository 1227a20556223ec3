"""On a family both backends build (Llama), FSDP and Megatron are the same policy: the same
initial log-probs (fp32, <= 1e-5) and the same first update (weights after one step of a
gradient-sized Adam step, :func:`~tests.megatron.helpers.gradient_step_spec`, to its rounding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlcore.specs import EvalSpec, ModelSpec
from rlcore.testing.tiny import build_tiny_llama
from rlcore_fsdp.backend import FSDPBackend
from tests.megatron.helpers import (
    TINY,
    assert_same_step,
    gradient_step_spec,
    make_batch,
    make_samples,
    weights,
)

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_llama(folder, **TINY)
    return folder


def test_initial_log_probs_are_megatrons(llama: Path) -> None:
    from rlcore_megatron.backend import MegatronBackend

    samples = make_samples(6, seed=4)
    spec = EvalSpec(ModelSpec("actor", llama, temperature=0.8))
    ours = FSDPBackend().build_eval_stack(spec).forward(samples)
    theirs = MegatronBackend().build_eval_stack(spec).forward(samples)
    for row, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(row), torch.tensor(expected), rtol=0, atol=1e-5)


def test_the_first_update_is_megatrons(llama: Path) -> None:
    from rlcore_megatron.backend import MegatronBackend

    samples = make_samples(4, seed=5)
    batch = make_batch(samples, seed=6, rollout=True)
    spec = gradient_step_spec(llama, global_batch_size=4, micro_batch_size=2)
    fsdp = FSDPBackend().build_training_stack(spec)
    megatron = MegatronBackend().build_training_stack(spec)
    before = weights(fsdp.export_weights())
    ours, theirs = fsdp.train_step(batch), megatron.train_step(batch)
    assert ours.loss == pytest.approx(theirs.loss, rel=1e-5, abs=1e-7)
    assert ours.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-4)
    got, expected = weights(fsdp.export_weights()), weights(megatron.export_weights())
    assert got.keys() == expected.keys()
    for name in expected:
        assert_same_step(got[name], expected[name], before[name], name)
