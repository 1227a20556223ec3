"""Micro-batches by a token budget (:mod:`rlcore.algorithms.token_budget`,
:func:`rlcore.algorithms.train_step.budget_micro_batches`): every sequence once, within the
budget, ranks balanced and with the same micro-batch count, and a train step cut by any budget
over any number of ranks is the whole batch's (gradient and metrics) in every aggregation mode,
multi-turn loss masks included."""

from __future__ import annotations

import typing

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.batching import TensorBatch, tensorize_samples
from rlcore.algorithms.token_budget import (
    budget_groups,
    forward_groups,
    forward_shares,
    in_input_order,
    padded_size,
    rank_micro_batches,
    rank_shares,
    split_largest,
)
from rlcore.algorithms.train_step import (
    budget_micro_batches,
    optimizer_step_batches,
    score_samples,
    step_micro_batches,
    step_tokens,
    trimmed,
)
from rlcore.samples import Sample, TrainBatch
from rlcore.specs import ISCorrection, LossAggMode, LossSpec, ModelSpec, ParallelSpec
from tests.algorithms.test_train_step import _step
from tests.megatron.helpers import make_samples, train_spec
from tests.strategies import VOCAB, log_prob, rows_for, samples

AGG_MODES = typing.get_args(LossAggMode)

long_tailed = st.lists(st.one_of(st.integers(1, 40), st.integers(1, 600)), min_size=1, max_size=24)


@given(long_tailed, st.data(), st.integers(1, 700))
def test_every_rank_runs_the_same_number_of_micro_batches_within_the_budget(
    lengths: list[int], data: st.DataObject, budget: int
) -> None:
    ranks = data.draw(st.sampled_from([d for d in (1, 2, 3, 4) if len(lengths) % d == 0]))
    plans = rank_micro_batches(lengths, budget, ranks)
    assert len(plans) == ranks
    # every sequence exactly once, each rank the same number of sequences
    flat = [i for plan in plans for group in plan for i in group]
    assert sorted(flat) == list(range(len(lengths)))
    assert {sum(len(g) for g in plan) for plan in plans} == {len(lengths) // ranks}
    # the same micro-batch count everywhere, none empty
    assert len({len(plan) for plan in plans}) == 1
    assert all(group for plan in plans for group in plan)
    for plan in plans:
        for group in plan:
            assert padded_size(lengths, group) <= budget or len(group) == 1
    # ranks balanced by tokens: within the longest sequence of each other
    loads = [sum(lengths[i] for group in plan for i in group) for plan in plans]
    assert max(loads) - min(loads) <= max(lengths)


@given(long_tailed, st.integers(1, 700))
def test_one_rank_needs_no_more_micro_batches_than_the_budget_forces(
    lengths: list[int], budget: int
) -> None:
    """Longest first, greedily: a new micro-batch starts only when the next sequence would not
    fit in the last one, or is less than half as long as its longest (so padding is under half
    of every micro-batch)."""
    groups = budget_groups(lengths, budget)
    for first, second in zip(groups, groups[1:], strict=False):
        overflows = padded_size(lengths, [*first, second[0]]) > budget
        assert overflows or 2 * lengths[second[0]] < lengths[first[0]]
    for group in groups:
        assert 2 * sum(lengths[i] for i in group) > padded_size(lengths, group)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))


def test_a_sequence_longer_than_the_budget_gets_a_micro_batch_of_its_own() -> None:
    # slime's behaviour, not a refusal: the long answer runs alone, the short ones together
    lengths = [32, 32, 512, 32, 32, 32, 32, 32]
    assert budget_groups(lengths, 256) == [[2], [0, 1, 3, 4, 5, 6, 7]]
    # a generous budget does not pad the short ones to the long one
    assert budget_groups(lengths, 8 * 512) == [[2], [0, 1, 3, 4, 5, 6, 7]]
    # the long one's rank takes three short ones (equal counts), the other rank four
    assert rank_micro_batches(lengths, 100, 2) == [[[2], [5, 6, 7]], [[0, 1, 3], [4]]]


def test_rank_shares_balance_a_long_tailed_batch() -> None:
    lengths = [512, 32, 32, 32, 32, 32, 32, 32, 512, 32]
    shares = rank_shares(lengths, 2)
    assert shares == [[0, 1, 3, 5, 7], [2, 4, 6, 8, 9]]  # 640 and 640 tokens
    with pytest.raises(ValueError, match="do not split evenly over 4"):
        rank_shares(lengths, 4)


@given(long_tailed, st.one_of(st.none(), st.integers(1, 700)), st.integers(1, 5))
def test_forward_groups_come_back_in_input_order(
    lengths: list[int], budget: int | None, micro: int
) -> None:
    groups = forward_groups(lengths, budget, micro)
    results = [[(i, lengths[i]) for i in group] for group in groups]
    assert in_input_order(groups, results) == [(i, n) for i, n in enumerate(lengths)]
    if budget is None:  # as before the budget existed: in order, ``micro`` at a time
        assert [i for g in groups for i in g] == list(range(len(lengths)))
        assert all(len(g) == micro for g in groups[:-1])


@given(long_tailed, st.integers(1, 5), st.one_of(st.none(), st.integers(1, 700)), st.integers(1, 4))
def test_forward_ranks_even_out_by_splitting_their_largest_micro_batches(
    lengths: list[int], ranks: int, budget: int | None, micro: int
) -> None:
    """Each rank's micro-batches of its forward share, split up to the most any rank forms:
    exactly that many unless the rank holds fewer sequences, each within the budget still."""
    shares = forward_shares(lengths, ranks, budget)
    own = [
        [[share[i] for i in g] for g in forward_groups([lengths[i] for i in share], budget, micro)]
        for share in shares
    ]
    count = max(len(groups) for groups in own)
    for share, groups in zip(shares, own, strict=True):
        even = split_largest(groups, count)
        assert len(even) == min(count, len(share)) and all(even)
        assert sorted(i for g in even for i in g) == share
        assert all(len(g) == 1 or budget is None or padded_size(lengths, g) <= budget for g in even)


@given(samples(min_size=0, max_size=6), st.integers(1, 3), st.integers(0, 8), st.booleans())
def test_scoring_runs_the_passes_the_ranks_agree_on_with_the_same_results(
    batch: list[Sample], micro: int, other: int, by_tokens: bool
) -> None:
    """``score_samples`` with ``all_max`` (here another rank that forms ``other`` micro-batches)
    runs the most micro-batches of any rank, split or thrown away, and scores as alone; each
    says the samples' tokens and exactly the positions it ran (its padding metric's counts)."""
    torch.manual_seed(0)
    table = torch.randn(VOCAB, VOCAB)  # each position's logits from its own token
    spec = ModelSpec("actor", None, log_probs_max_tokens_per_gpu=12 if by_tokens else None)
    calls: list[int] = []
    positions: list[int] = []

    def output(tb: TensorBatch) -> torch.Tensor:
        calls.append(tb.num_sequences)
        positions.append(tb.tokens.numel())
        return table[tb.tokens]

    alone = score_samples(output, batch, spec, 0, "cpu", micro)
    own = len(calls)
    tokens = sum(len(s.prompt.token_ids) + len(s.response.token_ids) for s in batch)
    assert (alone.sequence_tokens, alone.padded_tokens) == (tokens, sum(positions))
    calls.clear()
    positions.clear()
    agreed = score_samples(output, batch, spec, 0, "cpu", micro, lambda v: [max(v[0], other)])
    assert len(calls) == max(own, other)
    assert sum(calls) == len(batch) + max(other - len(batch), 0)  # one-token throwaways
    assert (agreed.sequence_tokens, agreed.padded_tokens) == (tokens, sum(positions))
    assert len(agreed) == len(batch)
    for got, want in zip(agreed, alone, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


@given(long_tailed, st.integers(1, 5), st.one_of(st.none(), st.integers(1, 700)))
def test_forward_shares_cover_every_sequence_once(
    lengths: list[int], ranks: int, budget: int | None
) -> None:
    """A forward-only pass over data-parallel ranks: any number of sequences; contiguous parts
    without a budget, with one the train step's balance by tokens (its very shares when the
    count splits evenly)."""
    shares = forward_shares(lengths, ranks, budget)
    n = len(lengths)
    assert len(shares) == ranks
    assert sorted(i for share in shares for i in share) == list(range(n))
    assert all(share == sorted(share) for share in shares)
    assert max(len(share) for share in shares) <= -(-n // ranks)
    if budget is None:  # as before the budget existed: in order, sizes within one, longer first
        assert [i for share in shares for i in share] == list(range(n))
        sizes = [len(share) for share in shares]
        assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
        return
    loads = [sum(lengths[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(lengths)
    if n % ranks == 0:
        assert shares == rank_shares(lengths, ranks)


def test_forward_shares_by_count_and_by_tokens() -> None:
    assert forward_shares([1] * 5, 2, None) == [[0, 1, 2], [3, 4]]
    assert forward_shares([1], 3, None) == forward_shares([1], 3, 8) == [[0], [], []]
    assert forward_shares([], 2, None) == forward_shares([], 2, 8) == [[], []]
    # one long answer: contiguous parts carry 545 and 64 tokens, balanced ones 513 and 96
    lengths = [512, 32, 1, 32, 32]
    assert forward_shares(lengths, 2, None) == [[0, 1, 2], [3, 4]]
    assert forward_shares(lengths, 2, 8) == [[0, 2], [1, 3, 4]]
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        forward_shares(lengths, 0, None)


def _with_loss_masks(data: st.DataObject, batch: list[Sample]) -> list[Sample]:
    """Some samples become multi-turn: a loss mask with environment tokens (0) in it."""
    out = []
    for s in batch:
        n = len(s.response.token_ids)
        if n and data.draw(st.booleans()):
            mask = tuple(data.draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)))
            s = attrs.evolve(s, response=attrs.evolve(s.response, loss_mask=mask))
        out.append(s)
    return out


@given(
    samples(min_size=1, max_size=6, max_response=5),
    st.data(),
    st.sampled_from(AGG_MODES),
    st.booleans(),
)
def test_any_token_budget_over_any_ranks_is_the_whole_batch(
    batch_samples: list[Sample], data: st.DataObject, mode: LossAggMode, correct: bool
) -> None:
    batch_samples = _with_loss_masks(data, batch_samples)
    ranks = data.draw(st.sampled_from([d for d in (1, 2, 3) if len(batch_samples) % d == 0]))
    budget = data.draw(st.integers(1, 30))
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
    spec = train_spec(None, global_batch_size=len(batch_samples), micro_batch_size=1)
    (global_batch,) = optimizer_step_batches(batch, spec, pad_id=0)
    seed = data.draw(st.integers(0, 2**16))
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed))
    weight.requires_grad_(True)
    whole_grad, whole, whole_tokens = _step(weight, global_batch, loss, len(batch_samples), 1)
    budgeted = attrs.evolve(spec, max_tokens_per_gpu=budget)
    grad, split, tokens = _step(
        weight,
        global_batch,
        loss,
        lambda b, rank, ranks: step_micro_batches(b, budgeted, rank, ranks),
        ranks,
    )
    torch.testing.assert_close(grad, whole_grad, rtol=1e-5, atol=1e-6)
    assert split.keys() == whole.keys() and tokens == whole_tokens
    for key, value in whole.items():
        assert split[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@given(samples(min_size=1, max_size=6, max_response=5), st.integers(1, 30), st.data())
def test_a_budget_micro_batch_is_padded_only_to_its_own_longest_sequence(
    batch_samples: list[Sample], budget: int, data: st.DataObject
) -> None:
    """Each micro-batch is what tensorizing its samples alone gives: nothing padded beyond its
    own longest sequence and response."""
    batch_samples = _with_loss_masks(data, batch_samples)
    rows = rows_for(data, batch_samples)
    batch = TrainBatch(samples=tuple(batch_samples), advantages=rows, returns=rows)
    spec = train_spec(None, global_batch_size=len(batch_samples), micro_batch_size=1)
    (global_batch,) = optimizer_step_batches(batch, spec, pad_id=0)
    lengths = [len(s.prompt.token_ids) + len(s.response.token_ids) for s in batch_samples]
    (plan,) = rank_micro_batches(lengths, budget, 1)
    micro_batches = budget_micro_batches(global_batch, budget)
    assert len(micro_batches) == len(plan)
    for group, mb in zip(plan, micro_batches, strict=True):
        alone = tensorize_samples([batch_samples[i] for i in group], pad_id=0)
        for name in ("tokens", "attention_mask", "response_index", "response_mask"):
            assert torch.equal(getattr(mb, name), getattr(alone, name)), name
        assert torch.equal(mb.loss_mask, alone.loss_mask)
        assert mb.returns is not None and mb.returns.shape == alone.response_mask.shape
    assert trimmed(global_batch).tokens.shape == global_batch.tokens.shape


def test_step_tokens_count_what_the_micro_batches_hold() -> None:
    """The padding metric's counts: by sample count every micro-batch has the rollout's width;
    by a budget each has its own longest sequence's, over every data-parallel rank."""
    batch_samples = make_samples(8, seed=5)
    rows = tuple((0.0,) * len(s.response.token_ids) for s in batch_samples)
    batch = TrainBatch(samples=tuple(batch_samples), advantages=rows)
    spec = train_spec(None, global_batch_size=8, micro_batch_size=2)
    (global_batch,) = optimizer_step_batches(batch, spec, pad_id=0)
    real = int(global_batch.attention_mask.sum())
    assert step_tokens(global_batch, spec) == (real, 8 * global_batch.tokens.shape[1])
    for ranks in (1, 2):
        budgeted = attrs.evolve(
            spec,
            model=attrs.evolve(spec.model, parallel=ParallelSpec(world_size=ranks)),
            max_tokens_per_gpu=12,
        )
        held = [
            mb.tokens.numel()
            for rank in range(ranks)
            for mb in step_micro_batches(global_batch, budgeted, rank, ranks)
        ]
        assert step_tokens(global_batch, budgeted) == (real, sum(held))
        assert real <= sum(held) < 8 * global_batch.tokens.shape[1]
