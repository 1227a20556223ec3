"""Two gloo ranks on the CPU train as one process does with the same global batch (FSDP2 shards
every layer over both, each takes half the batch), send the full weights from the rank that has
the sink, and their checkpoint loads into one process (DCP reshards it); one process's checkpoint
resumes on two ranks with the same weights, optimizer state and learning rate, and their next
step is the step the process itself takes next."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from rlcore.samples import TrainBatch
from rlcore.specs import TrainSpec
from rlcore_fsdp.backend import FSDPBackend
from rlcore_fsdp.stacks import FSDPTrainingStack
from tests.fsdp import multirank_worker
from tests.megatron.helpers import (
    TOKEN_MEAN_TIS,
    assert_same_step,
    gradient_step_spec,
    make_batch,
    make_samples,
    run_two_ranks,
    weights,
)

pytestmark = pytest.mark.slow


def batch_and_spec(folder: Path) -> tuple[TrainBatch, TrainSpec]:
    """A global batch of 4 in micro-batches of 1, with the token-mean loss (its normaliser is the
    global batch's token count) and an importance correction; a gradient-sized Adam step."""
    batch = make_batch(make_samples(4, seed=21, vocab=40), seed=22, rollout=True)
    spec = gradient_step_spec(folder, global_batch_size=4, micro_batch_size=1, loss=TOKEN_MEAN_TIS)
    return batch, spec


def full_optimizer_state(stack: FSDPTrainingStack) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state by parameter name, gathered whole on rank 0 (empty on the others), as
    copies: on one rank the full state holds live tensors (the step count), which steps change."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    gathered = get_optimizer_state_dict(stack.model, stack.optimizer, options=full)
    state = cast("dict[str, dict[str, torch.Tensor]]", gathered.get("state", {}))
    return {name: {k: v.clone() for k, v in s.items()} for name, s in state.items()}


def next_batch() -> TrainBatch:
    """The batch of the step after a resume (other samples than :func:`batch_and_spec`'s)."""
    return make_batch(make_samples(4, seed=23, vocab=40), seed=24, rollout=True)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpt2_folder(tmp_path_factory.mktemp("gpt2"))


def gpt2_folder(folder: Path) -> Path:
    """A tiny GPT-2: tied embeddings, absolute positions, biases everywhere."""
    from rlcore.new_model import write_model

    config = transformers.GPT2Config(
        vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    write_model(folder, config.to_dict(), seed=5)
    return folder


@pytest.fixture(scope="module")
def one_rank(gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process's step, its checkpoint (``ckpt`` in ``folder``), the weights, AdamW state and
    learning rate it saved, and its next step's loss and weights."""
    folder = tmp_path_factory.mktemp("one_rank")
    batch, spec = batch_and_spec(gpt2)
    one = FSDPBackend().build_training_stack(spec)
    one.train_step(batch)
    one.save(folder / "ckpt", rollout_id=3)
    saved = {
        "folder": folder,
        "weights": weights(one.export_weights()),
        "optimizer": full_optimizer_state(one),
        "lr": one.optimizer.param_groups[0]["lr"],
        "loss": one.train_step(next_batch()).loss,
        "stepped": weights(one.export_weights()),
    }
    return saved


@pytest.fixture(scope="module")
def two_ranks(
    gpt2: Path, one_rank: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """What both ranks wrote: their own step and checkpoint, then the resume of ``one_rank``'s."""
    out = tmp_path_factory.mktemp("two_ranks")
    resume_from = str(one_rank["folder"] / "ckpt")
    run_two_ranks(multirank_worker.run, str(gpt2), str(out), 0, resume_from, timeout=300)
    return out


def _rank(out: Path, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = torch.load(out / f"rank{rank}.pt")
    return result


def test_two_ranks_take_the_step_and_report_the_metrics_of_one(two_ranks: Path, gpt2: Path) -> None:
    batch, spec = batch_and_spec(gpt2)
    one = FSDPBackend().build_training_stack(spec)
    before = weights(one.export_weights())
    metrics = one.train_step(batch)
    expected = weights(one.export_weights())
    sent = _rank(two_ranks, 0)["sent"]
    assert sent.keys() == expected.keys() and _rank(two_ranks, 1)["sent"] == {}
    for name, tensor in expected.items():
        assert_same_step(sent[name], tensor, before[name], name)
    for rank in range(2):
        result = _rank(two_ranks, rank)
        assert result["tokens"] == metrics.tokens
        assert result["loss"] == pytest.approx(metrics.loss, rel=1e-5)
        assert result["grad_norm"] == pytest.approx(metrics.grad_norm, rel=1e-4)
        for key, value in metrics.extra.items():
            assert result["extra"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_a_two_rank_checkpoint_loads_into_one_process(two_ranks: Path, gpt2: Path) -> None:
    batch, spec = batch_and_spec(gpt2)
    one = FSDPBackend().build_training_stack(spec)
    assert one.load(two_ranks / "ckpt") == 3
    loaded = weights(one.export_weights())
    sent = _rank(two_ranks, 0)["sent"]
    assert all(torch.equal(loaded[name], sent[name]) for name in sent)
    assert one.forward(list(batch.samples)) == _rank(two_ranks, 0)["log_probs"]
    # in-process ranks whose shares form different numbers of micro-batches (#36)
    uneven = _rank(two_ranks, 0)["uneven"]
    assert _rank(two_ranks, 1)["uneven"] == [] and len(uneven) == 3
    for got, want in zip(uneven, one.forward(list(batch.samples)[:3]), strict=True):
        assert got == pytest.approx(want, abs=1e-5)


def test_a_one_rank_checkpoint_resumes_on_two_ranks(
    two_ranks: Path, one_rank: dict[str, Any]
) -> None:
    resumed: dict[str, Any] = torch.load(two_ranks / "resumed.pt")
    assert resumed["rollout_id"] == 3 and resumed["lr"] == one_rank["lr"]
    saved = one_rank["weights"]
    assert resumed["loaded"].keys() == saved.keys()
    assert all(torch.equal(resumed["loaded"][name], saved[name]) for name in saved)
    optimizer = one_rank["optimizer"]
    assert resumed["optimizer"].keys() == optimizer.keys()
    for name in optimizer:
        assert optimizer[name].keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in optimizer[name].items():
            assert torch.equal(resumed["optimizer"][name][key], value), (name, key)
    assert resumed["loss"] == pytest.approx(one_rank["loss"], rel=1e-5)
    for name, tensor in one_rank["stepped"].items():
        assert_same_step(resumed["stepped"][name], tensor, saved[name], name)
