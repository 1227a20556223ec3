"""A CPU rank's FSDP weights leave without a copy (issue #36): its parameters' shards live in
shared memory (as Megatron's do), and on one rank, where a shard is the whole tensor, the export
gives the live parameters themselves, so the embedded engine's sync hands them to the driver as
they are (no handoff buffer), before and after a step. An eval stack's stay in private memory."""

from __future__ import annotations

from pathlib import Path
from typing import final

import pytest
import torch
from safetensors.torch import load_file

from rlcore.engines.shared_tensors import SharedBuffers, in_shared_memory, is_shared_parameter
from rlcore.specs import EvalSpec
from rlcore.testing.tiny import build_tiny_llama
from rlcore.weights import InProcess, NamedTensors, Takes
from rlcore_fsdp.backend import FSDPBackend, local_shard
from tests.megatron.helpers import TINY, make_batch, make_samples, train_spec


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    build_tiny_llama(folder, **TINY)
    return folder


def test_one_cpu_rank_exports_its_shared_parameters_as_they_are(llama: Path) -> None:
    stack = FSDPBackend().build_training_stack(train_spec(llama))
    live = {local_shard(p).data_ptr() for p in stack.model.parameters()}
    assert all(in_shared_memory(local_shard(p)) for p in stack.model.parameters())
    exported = list(stack.export_weights())
    hf = load_file(str(llama / "model.safetensors"))
    assert sorted(name for name, _ in exported) == sorted(hf)
    for name, tensor in exported:
        assert torch.equal(tensor, hf[name]), name
        assert tensor.data_ptr() in live, name  # the parameter itself, not a gathered copy
    buffers = SharedBuffers(1)
    assert buffers.share(exported, 0, keep_cuda=False) == exported
    assert buffers.buffers == (None,)  # nothing copied into the handoff buffer
    stack.train_step(make_batch(make_samples(4, seed=5), seed=6, rollout=True))
    stepped = list(stack.export_weights())
    assert any(not torch.equal(t, hf[name]) for name, t in stepped)
    assert all(in_shared_memory(t) and t.data_ptr() in live for _, t in stepped)
    # what lets the embedded engine's next sync copy from them without calling the rank
    assert all(is_shared_parameter(t) for _, t in stepped)


def test_an_eval_stack_keeps_its_parameters_in_private_memory(llama: Path) -> None:
    # its weights are sent once if ever; moving them cost an eval-only bring-up's peak RSS
    stack = FSDPBackend().build_eval_stack(EvalSpec(train_spec(llama).model))
    assert not any(in_shared_memory(local_shard(p)) for p in stack.model.parameters())


def test_bf16_weights_are_sent_from_shared_buffers_that_steps_leave_alone(llama: Path) -> None:
    """Under ``--bf16`` the weights sent are bf16 casts of the fp32 parameters, made into the
    stack's shared export buffers (reused sync after sync, so the handoff copies nothing), which
    a step does not change."""
    stack = FSDPBackend().build_training_stack(train_spec(llama, precision="bfloat16"))
    first, second = _Kept(), _Kept()
    stack.send_weights([first])
    expected = {name: t.clone() for name, t in stack.export_weights()}
    assert {name: t.dtype for name, t in first.pairs} == dict.fromkeys(expected, torch.bfloat16)
    assert all(torch.equal(t, expected[name]) for name, t in first.pairs)
    buffers = SharedBuffers(1)
    assert buffers.share(first.pairs, 0, keep_cuda=False) == first.pairs
    assert buffers.buffers == (None,)
    assert not any(is_shared_parameter(t) for _, t in first.pairs)  # casts: made each sync
    stack.train_step(make_batch(make_samples(4, seed=5), seed=6, rollout=True))
    assert all(torch.equal(t, expected[name]) for name, t in first.pairs)
    stack.send_weights([second])
    assert [t.data_ptr() for _, t in second.pairs] == [t.data_ptr() for _, t in first.pairs]
    assert any(not torch.equal(t, expected[name]) for name, t in second.pairs)
    # A sink that casts as it copies (the embedded engine's) gets the fp32 parameters
    # themselves: one copy, and nothing the next sync must ask the rank for.
    casting = _Kept(Takes(any_dtype=True))
    stack.send_weights([casting])
    assert all(t.dtype == torch.float32 and is_shared_parameter(t) for _, t in casting.pairs)
    cast = {name: t.to(torch.bfloat16) for name, t in casting.pairs}
    assert cast.keys() == expected.keys()
    assert all(torch.equal(t, cast[name]) for name, t in second.pairs)


@final
class _Kept:
    """An in-process sink that keeps the tensors it is given."""

    def __init__(self, takes: Takes | None = None) -> None:
        self.pairs: list[tuple[str, torch.Tensor]] = []
        self.takes = takes or Takes()

    @property
    def placement(self) -> InProcess:
        return InProcess()

    def receive(self, weights: NamedTensors) -> None:
        self.pairs = list(weights)
