"""The launcher's data-parallel ``forward`` with a token budget (``--use-dynamic-batch-size``):
each data-parallel rank scores a share balanced by tokens as the train step's are
(:func:`rlcore.algorithms.token_budget.forward_shares`), and the results come back in the
samples' order. Real Ray, two ranks: the light stand-in runtime of ``test_ray_group`` shows who
scored what; the real Megatron backend over gloo gives the values of one process, padded or by
the budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.algorithms.token_budget import sequence_lengths
from rlcore.launch.ray.ranks import GroupOptions, RankGroup
from rlcore.launch.ray.stacks import RayBackend, forward
from rlcore.samples import ForwardRows, Sample
from rlcore.specs import EvalSpec, ModelSpec, ParallelSpec
from tests.launch.test_ray_group import EchoRuntime, _sample, _seen
from tests.megatron.helpers import TINY

pytest_plugins = ["tests.conftest_ray"]

pytestmark = pytest.mark.ray

BUDGET = 24
"""Padded tokens per forward micro-batch: a long sample alone, short ones a few together."""

RESPONSES = (20, 18, 2, 3, 2, 3, 2)
"""Response lengths (prompts of 2 tokens): two long answers first, then short ones."""

_OPTIONS = GroupOptions(setup_timeout_s=300, call_timeout_s=300)


def _samples() -> list[Sample]:
    return [
        _sample(i, (1, 3 + i), tuple(4 + (i + j) % 20 for j in range(n)))
        for i, n in enumerate(RESPONSES)
    ]


def _spec(hf: Path | None, world_size: int, budget: int | None) -> EvalSpec:
    parallel = ParallelSpec(1, world_size)
    model = ModelSpec("reference", hf, parallel=parallel, log_probs_max_tokens_per_gpu=budget)
    return EvalSpec(model)


def test_each_rank_scores_a_share_balanced_by_tokens(ray_cluster: None) -> None:
    samples = _samples()
    lengths = sequence_lengths(samples)
    assert lengths == [22, 20, 4, 5, 4, 5, 4]
    expected = [tuple(float(i) for _ in s.response.token_ids) for i, s in enumerate(samples)]
    for budget, shares, loads in (
        (None, [[0, 1, 2, 3], [4, 5, 6]], [51, 13]),  # contiguous, as without a budget
        (BUDGET, [[0, 4, 5], [1, 2, 3, 6]], [31, 33]),  # longest first to the lighter rank
    ):
        group = RankGroup.start_eval(_spec(None, 2, budget), EchoRuntime((3, 3)), _OPTIONS)
        try:
            got = forward(group, samples)
            assert got == expected  # in the samples' order
            assert type(got) is list  # the stand-in's plain lists say nothing of positions
            seen = group.run_on_all_ranks(_seen)
        finally:
            group.close()
        assert seen == shares
        assert [sum(lengths[i] for i in share) for share in seen] == loads


@pytest.mark.megatron
def test_two_megatron_ranks_score_by_tokens_as_one_process(
    ray_cluster: None, tmp_path: Path
) -> None:
    """Data parallel 2 by the budget gives one process's log-probs, padded and by the budget."""
    from rlcore.testing.tiny import build_tiny_llama
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.kind import MegatronRuntime

    folder = tmp_path / "llama"
    build_tiny_llama(folder, **TINY)
    samples = _samples()
    one = [
        MegatronBackend().build_eval_stack(_spec(folder, 1, budget)).forward(samples)
        for budget in (None, BUDGET)
    ]
    with RayBackend(MegatronRuntime(), None, _OPTIONS) as backend:
        two = backend.build_eval_stack(_spec(folder, 2, BUDGET)).forward(samples)
    assert [len(r) for r in two] == list(RESPONSES)
    # The positions run, for the padding metric (64 real tokens): one process padded to 22, or
    # by the budget [22] [20] [5, 5, 4, 4] [4]; two ranks [22] [5, 4] and [20] [5, 4, 4], summed.
    for rows, positions in zip((*one, two), (7 * 22, 22 + 20 + 4 * 5 + 4, 32 + 35), strict=True):
        assert isinstance(rows, ForwardRows)
        assert (rows.sequence_tokens, rows.padded_tokens) == (64, positions)
    for expected in one:
        for got, want in zip(two, expected, strict=True):
            assert got == pytest.approx(want, abs=1e-5)
