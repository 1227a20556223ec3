"""The train-step arithmetic every backend shares (:mod:`rlcore.algorithms.train_step`): however
a global batch is cut over data-parallel ranks and micro-batches, the summed gradient and the
reduced metrics are those of the whole batch in one piece, in every aggregation mode."""

from __future__ import annotations

import threading
import typing
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.batching import TensorBatch, token_log_probs
from rlcore.algorithms.losses import actor_loss
from rlcore.algorithms.train_step import (
    StepMetrics,
    local_micro_batches,
    optimizer_step_batches,
)
from rlcore.errors import PlanError
from rlcore.samples import Sample, TrainBatch
from rlcore.specs import ISCorrection, LossAggMode, LossSpec
from tests.megatron.helpers import train_spec
from tests.strategies import VOCAB, log_prob, rows_for, samples

AGG_MODES = typing.get_args(LossAggMode)


Cut = Callable[[TensorBatch, int, int], list[TensorBatch]]
"""A rank's micro-batches of a global batch: ``cut(global_batch, rank, ranks)``."""


def by_count(micro: int) -> Cut:
    """Micro-batches of ``micro`` sequences (:func:`local_micro_batches`)."""
    return lambda batch, rank, ranks: local_micro_batches(batch, micro, rank, ranks)


def _step(
    weight: torch.Tensor, global_batch: TensorBatch, spec: LossSpec, cut: Cut | int, ranks: int
) -> tuple[torch.Tensor, dict[str, float], int]:
    """One optimizer step's gradient and metrics with the global batch cut over ``ranks``
    simulated data-parallel ranks (threads meeting in an all-reduce) into micro-batches by
    ``cut`` (an int: micro-batches of that many sequences); the gradient summed over the ranks,
    as DDP does."""
    if isinstance(cut, int):
        cut = by_count(cut)
    weight.grad = None
    barrier = threading.Barrier(ranks)
    posted: list[list[float]] = [[] for _ in range(ranks)]
    results: list[tuple[dict[str, float], int]] = [({}, 0)] * ranks
    lock = threading.Lock()

    def collective(
        rank: int, combine: Callable[[list[float]], float]
    ) -> Callable[..., list[float]]:
        def reduce(values: list[float]) -> list[float]:
            posted[rank] = values
            barrier.wait()
            out = [combine([posted[r][i] for r in range(ranks)]) for i in range(len(values))]
            barrier.wait()
            return out

        return reduce

    def rank_step(rank: int) -> None:
        step = StepMetrics(global_batch, spec.agg_mode)
        for mb in cut(global_batch, rank, ranks):
            out = actor_loss(token_log_probs(weight[mb.tokens], mb), mb, spec)
            with lock:  # autograd accumulates into weight.grad from one thread at a time
                torch.autograd.backward(out.loss / step.normalizer)
            step.add(out)
        results[rank] = (step.reduce(collective(rank, sum), collective(rank, max)), step.tokens)

    threads = [threading.Thread(target=rank_step, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert weight.grad is not None
    assert all(r == results[0] for r in results)  # every rank ends with the same metrics
    return weight.grad.clone(), *results[0]


@given(
    samples(min_size=1, max_size=6, max_response=5),
    st.data(),
    st.sampled_from(AGG_MODES),
    st.booleans(),
)
def test_any_split_over_ranks_and_micro_batches_is_the_whole_batch(
    batch_samples: list[Sample], data: st.DataObject, mode: LossAggMode, correct: bool
) -> None:
    ranks = data.draw(st.sampled_from([d for d in (1, 2, 3) if len(batch_samples) % d == 0]))
    per_rank = len(batch_samples) // ranks
    micro = data.draw(st.integers(1, per_rank))
    batch = TrainBatch(
        samples=tuple(batch_samples),
        advantages=rows_for(data, batch_samples),
        old_log_probs=rows_for(data, batch_samples, log_prob),
        rollout_log_probs=tuple(s.response.log_probs for s in batch_samples),
    )
    loss = LossSpec(
        agg_mode=mode,
        agg_constant=5,
        correction=ISCorrection(low=0.5, high=2.0) if correct else None,
    )
    # The spec's own micro-batch size plays no part here: the split is drawn above (a last
    # micro-batch shorter than the others included).
    spec = train_spec(None, global_batch_size=len(batch_samples), micro_batch_size=1)
    (global_batch,) = optimizer_step_batches(batch, spec, pad_id=0)
    seed = data.draw(st.integers(0, 2**16))
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
    weight.requires_grad_(True)
    whole_grad, whole, whole_tokens = _step(weight, global_batch, loss, len(batch_samples), 1)
    grad, split, tokens = _step(weight, global_batch, loss, micro, ranks)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-6)
    assert split.keys() == whole.keys() and tokens == whole_tokens
    for key, value in whole.items():
        assert split[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@given(samples(min_size=2).filter(lambda batch: len(batch) % 2 == 0))
def test_a_rollout_is_cut_into_its_optimizer_steps_in_order(batch_samples: list[Sample]) -> None:
    rows = tuple((0.0,) * len(s.response.token_ids) for s in batch_samples)
    batch = TrainBatch(samples=tuple(batch_samples), advantages=rows)
    half = len(batch_samples) // 2
    spec = train_spec(None, global_batch_size=half, micro_batch_size=1, steps_per_rollout=2)
    first, second = optimizer_step_batches(batch, spec, pad_id=0)
    assert first.num_sequences == second.num_sequences == half
    tokens = [list(s.prompt.token_ids) for s in batch_samples]
    assert [row[: len(t)] for row, t in zip(first.tokens.tolist(), tokens[:half], strict=True)] == (
        tokens[:half]
    )
    assert [
        row[: len(t)] for row, t in zip(second.tokens.tolist(), tokens[half:], strict=True)
    ] == (tokens[half:])
    whole_width = max(len(s.prompt.token_ids) + len(s.response.token_ids) for s in batch_samples)
    assert first.tokens.shape[1] == second.tokens.shape[1] == whole_width
    wrong = train_spec(None, global_batch_size=half, micro_batch_size=1, steps_per_rollout=3)
    with pytest.raises(PlanError, match=r"steps_per_rollout=3 x global_batch_size="):
        optimizer_step_batches(batch, wrong, pad_id=0)
