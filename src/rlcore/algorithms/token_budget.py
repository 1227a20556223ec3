"""Micro-batches by a token budget (``--use-dynamic-batch-size --max-tokens-per-gpu N``), as index
lists over a batch's sequences: pure Python on sequence lengths, the same on every rank.

A micro-batch is padded to its own longest sequence, so what it costs the device is its
*padded* size, ``len(micro_batch) * longest``; the budget bounds that. Sequences are sorted
longest first and filled greedily (:func:`budget_groups`): neighbours in that order have similar
lengths, and a micro-batch also closes before a sequence less than half as long as its longest,
so less than half of any micro-batch is padding (without that rule a generous budget would pad
a batch's short answers to its one long answer, as cutting by sample count does). A sequence
longer than the budget gets a micro-batch of its own, as slime does (the budget is then exceeded
by that one sequence, never refused).

A train step's global batch is first shared out over the data-parallel ranks
(:func:`rank_shares`): the same number of sequences each, longest first to the rank with the
fewest tokens, so the ranks carry about the same number of tokens (within the longest sequence
of each other). Every rank then runs the same number of micro-batches
(:func:`rank_micro_batches`), which collectives that run in every micro-batch (expert parallel
all-to-all, FSDP's gathers) need: a rank with fewer splits its largest micro-batches in two
(halves are within the budget too) until it has as many as the rank with the most. A rank holds
``n / D`` sequences and no rank needs more micro-batches than that, so no micro-batch is ever
empty. Every rank receives the whole global batch and computes every rank's plan itself: no
collective is needed.

A forward-only pass (old and reference log-probs, a critic's values, a teacher) over several
data-parallel ranks is shared out the same way (:func:`forward_shares`, by the launcher, which
sends each rank its share and puts the results back in the samples' order with
:func:`in_input_order`): any number of sequences, at most ``ceil(n / D)`` to a rank, a rank
with none called too. Where the forward has a collective in every micro-batch (FSDP's gathers),
the ranks agree on the most micro-batches any of them forms and the others even out as a train
step's do (:func:`split_largest`), running a throwaway forward for each pass still missing when
they hold too few sequences (:func:`rlcore.algorithms.train_step.score_samples`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rlcore.samples import Sample

__all__ = [
    "budget_groups",
    "forward_groups",
    "forward_shares",
    "in_input_order",
    "padded_positions",
    "padded_size",
    "rank_micro_batches",
    "rank_shares",
    "sequence_lengths",
    "split_largest",
]

_T = TypeVar("_T")


def sequence_lengths(samples: Sequence[Sample]) -> list[int]:
    """Each sample's tokens, prompt and response: what a micro-batch pads and a budget counts."""
    return [len(s.prompt.token_ids) + len(s.response.token_ids) for s in samples]


def padded_size(lengths: Sequence[int], group: Sequence[int]) -> int:
    """The tokens ``group`` (indices into ``lengths``) occupies padded to its longest sequence."""
    return len(group) * max((lengths[i] for i in group), default=0)


def padded_positions(lengths: Sequence[int], groups: Sequence[Sequence[int]]) -> int:
    """The positions micro-batches ``groups`` (index lists into ``lengths``) take, each padded to
    its own longest sequence: what a pass over them runs, for its padding metric."""
    return sum(padded_size(lengths, group) for group in groups)


def budget_groups(
    lengths: Sequence[int], max_tokens: int, indices: Sequence[int] | None = None
) -> list[list[int]]:
    """``indices`` (default: all of ``lengths``) cut into micro-batches whose padded size is at
    most ``max_tokens``, longest sequences first; a sequence longer than ``max_tokens`` alone,
    and a sequence less than half as long as a micro-batch's longest starts the next one. Each
    group lists its indices longest first."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)) if indices is None else indices, key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        # Longest first: a group's longest sequence is its first.
        longest = lengths[groups[-1][0]] if groups else 0
        if groups and (len(groups[-1]) + 1) * longest <= max_tokens and 2 * lengths[i] >= longest:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def rank_shares(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """The indices of ``lengths`` shared out over ``ranks``: ``len(lengths) / ranks`` each (which
    must be whole), longest first to the rank with the fewest tokens so far among those with room
    (ties: the lower rank), each share in ascending index order."""
    n = len(lengths)
    if ranks < 1 or n % ranks:
        raise ValueError(f"{n} sequences do not split evenly over {ranks} data-parallel ranks")
    return _balanced(lengths, ranks, n // ranks)


def forward_shares(lengths: Sequence[int], ranks: int, max_tokens: int | None) -> list[list[int]]:
    """Each data-parallel rank's share of a forward-only pass's sequences (index lists, ascending):
    without a budget (``max_tokens`` ``None``) contiguous parts whose sizes differ by at most one,
    longer first; with one, :func:`rank_shares`' balance by tokens for any number of sequences,
    at most ``ceil(len(lengths) / ranks)`` to a rank. With fewer sequences than ranks, the last
    ranks get none."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    n = len(lengths)
    if max_tokens is not None:
        return _balanced(lengths, ranks, -(-n // ranks))
    size, extra = divmod(n, ranks)
    starts = [r * size + min(r, extra) for r in range(ranks + 1)]
    return [list(range(starts[r], starts[r + 1])) for r in range(ranks)]


def _balanced(lengths: Sequence[int], ranks: int, room: int) -> list[list[int]]:
    """Longest first to the rank with the fewest tokens among those holding fewer than ``room``
    (ties: the lower rank); each share in ascending index order."""
    shares: list[list[int]] = [[] for _ in range(ranks)]
    loads = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min((r for r in range(ranks) if len(shares[r]) < room), key=lambda r: loads[r])
        shares[r].append(i)
        loads[r] += lengths[i]
    return [sorted(share) for share in shares]


def rank_micro_batches(
    lengths: Sequence[int], max_tokens: int, ranks: int
) -> list[list[list[int]]]:
    """Every data-parallel rank's micro-batches (index lists into ``lengths``): the rank's
    :func:`rank_shares` cut by :func:`budget_groups`, then evened out to the same count on every
    rank by splitting each rank's largest micro-batches (module docstring)."""
    plans = [budget_groups(lengths, max_tokens, share) for share in rank_shares(lengths, ranks)]
    count = max(len(plan) for plan in plans)
    # Every rank holds >= count sequences, so each reaches count.
    return [split_largest(plan, count) for plan in plans]


def split_largest(groups: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """``groups`` with the one holding the most sequences (ties: the first) split in two, the
    first half the larger, until there are ``count`` of them or none holds two: how a rank with
    fewer micro-batches than another evens out (halves of a micro-batch within a budget are
    within it too)."""
    plan = [list(group) for group in groups]
    while len(plan) < count:
        k = max(range(len(plan)), key=lambda j: (len(plan[j]), -j), default=0)
        if not plan or len(plan[k]) < 2:
            break
        group = plan[k]
        half = (len(group) + 1) // 2
        plan[k : k + 1] = [group[:half], group[half:]]
    return plan


def forward_groups(
    lengths: Sequence[int], max_tokens: int | None, micro_batch: int
) -> list[list[int]]:
    """A forward-only pass's micro-batches over sequences of ``lengths`` (every rank scores the
    whole batch): by the budget ``max_tokens`` (:func:`budget_groups`), or with ``None`` in
    order, ``micro_batch`` sequences each. Put the results back with :func:`in_input_order`."""
    if max_tokens is not None:
        return budget_groups(lengths, max_tokens)
    n = len(lengths)
    return [list(range(s, min(s + micro_batch, n))) for s in range(0, n, micro_batch)]


def in_input_order(groups: Sequence[Sequence[int]], results: Sequence[Sequence[_T]]) -> list[_T]:
    """Per-group results (``results[g][k]`` belongs to index ``groups[g][k]``) as one list in
    index order; ``groups`` must cover ``0 .. n - 1`` once each."""
    out: dict[int, _T] = {}
    for group, rows in zip(groups, results, strict=True):
        out.update(zip(group, rows, strict=True))
    if sorted(out) != list(range(len(out))):
        raise ValueError("in_input_order: the groups do not cover 0 .. n - 1 once each")
    return [out[i] for i in range(len(out))]
