"""``--gradient-checkpointing`` with the FSDP backend: each decoder layer recomputes its
activations in the backward pass, and nothing else changes: the same step to the bit, the same
weight names out, checkpoints that load into a stack without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from rlcore.specs import EvalSpec
from rlcore.testing.tiny import build_tiny_llama
from rlcore_fsdp.backend import FSDPBackend
from rlcore_fsdp.options import FSDPOptions
from tests.megatron.helpers import TINY, make_batch, make_samples, train_spec, weights


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_llama(folder, **{**TINY, "tie_word_embeddings": True})
    return folder


def test_checkpointed_layers_take_the_same_step(llama: Path, tmp_path: Path) -> None:
    samples = make_samples(4, seed=7)
    batch = make_batch(samples, seed=8, rollout=True)
    spec = train_spec(llama, global_batch_size=4, micro_batch_size=2)
    plain = FSDPBackend().build_training_stack(spec)
    recomputing = FSDPBackend(FSDPOptions(gradient_checkpointing=True)).build_training_stack(spec)
    wrapped = [m for m in recomputing.model.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrapped) == TINY["num_layers"]
    expected, got = plain.train_step(batch), recomputing.train_step(batch)
    assert got.loss == expected.loss and got.grad_norm == expected.grad_norm
    a, b = weights(plain.export_weights()), weights(recomputing.export_weights())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)

    recomputing.save(tmp_path, rollout_id=1)
    loaded = FSDPBackend().build_eval_stack(EvalSpec(spec.model))
    assert loaded.load(tmp_path) == 1
    assert loaded.forward(samples) == recomputing.forward(samples)
