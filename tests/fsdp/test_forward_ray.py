"""Scoring with FSDP over two data-parallel ranks through the Ray launcher (#36): FSDP2 gathers
each unit's shards in every forward, so both ranks must run the same number of forward passes.
The launcher calls a rank whose share is empty too, and the ranks agree on the most micro-batches
either forms (:func:`rlcore.algorithms.train_step.score_samples`); without that, one sample on two
ranks, or shares that form different numbers of micro-batches, leave a rank waiting forever in a
gather. Each case must give one process's log-probs within the group's call timeout (a hang fails
instead of stalling CI).

One group per stack kind, reused by its cases: an eval stack scoring by a token budget, and a
training stack scoring by sample count, one sample per micro-batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Final

import attrs
import pytest
import torch

from rlcore.algorithms.token_budget import forward_groups, forward_shares, sequence_lengths
from rlcore.launch.ray.ranks import GroupOptions
from rlcore.launch.ray.stacks import RayBackend, RayEvalStack, RayTrainingStack
from rlcore.launch.ray.worker import RankContext
from rlcore.protocols.stacks import ModelStack
from rlcore.samples import ForwardRows, Generation, Prompt, Sample
from rlcore.specs import EvalSpec, ParallelSpec
from rlcore_fsdp.kind import FSDPRuntime
from rlcore_fsdp.options import FSDPOptions
from rlcore_fsdp.stacks import FSDPTrainingStack
from tests.fsdp.test_lora import _log_probs, llama  # noqa: F401  # llama: a fixture
from tests.megatron.helpers import TINY, train_spec

pytest_plugins = ["tests.conftest_ray"]

pytestmark = [pytest.mark.slow, pytest.mark.ray]

BUDGET: Final = 24
"""Padded tokens per forward micro-batch of the eval stack."""

OPTIONS: Final = GroupOptions(setup_timeout_s=300, call_timeout_s=120)

CASES: Final = {
    "one sample": (7,),
    "three samples": (30, 8, 5),
    "long-tailed": (40, 6, 6, 6, 6, 6, 6),
}
"""Sequence lengths (prompts of two tokens). The long-tailed mix gives the ranks different
numbers of micro-batches both by the budget (the long one alone on one rank with two short
ones, four short ones in one micro-batch on the other) and by count (4 and 3)."""

POSITIONS: Final = {
    # by the budget: the long ones alone, short ones together; the idle rank's throwaway 1
    "eval": {"one sample": 7 + 1, "three samples": 30 + 2 * 8, "long-tailed": 40 + 6 * 6},
    # one sample per micro-batch: no padding, but a throwaway pass on the rank with fewer
    "train": {"one sample": 7 + 1, "three samples": 43 + 1, "long-tailed": 76 + 1},
}
"""The positions both ranks together run for each case, by hand (the padding metric's
denominator; the launcher sums the ranks')."""


def _samples(lengths: tuple[int, ...]) -> list[Sample]:
    out = []
    for i, n in enumerate(lengths):
        response = tuple(3 + (5 * i + j) % 29 for j in range(n - 2))
        generation = Generation(response, tuple(-1.0 for _ in response), "")
        out.append(Sample(Prompt(i, "", (1, 3 + i)), generation, 0.0, i))
    return out


def _one_per_micro_batch(context: RankContext[ModelStack]) -> None:
    stack = context.stack
    assert isinstance(stack, FSDPTrainingStack)
    stack.forward_micro_batch = 1


def _micro_batches(lengths: tuple[int, ...], budget: int | None, micro: int) -> list[int]:
    """How many micro-batches each of two ranks forms on its own."""
    return [
        len(forward_groups([lengths[i] for i in share], budget, micro))
        for share in forward_shares(lengths, 2, budget)
    ]


@pytest.fixture(scope="module", params=["eval", "train"])
def stack(
    request: pytest.FixtureRequest,
    ray_cluster: None,
    llama: Path,  # noqa: F811  # the fixture imported above
) -> Iterator[RayEvalStack | RayTrainingStack]:
    spec = train_spec(llama)
    model = attrs.evolve(spec.model, parallel=ParallelSpec(world_size=2))
    with RayBackend(FSDPRuntime(FSDPOptions()), options=OPTIONS) as backend:
        if request.param == "eval":
            model = attrs.evolve(model, log_probs_max_tokens_per_gpu=BUDGET)
            yield backend.build_eval_stack(EvalSpec(model))
        else:
            training = backend.build_training_stack(attrs.evolve(spec, model=model))
            training.group.run_on_all_ranks(_one_per_micro_batch)
            yield training


def test_the_cases_give_the_ranks_different_work() -> None:
    assert _micro_batches(CASES["one sample"], BUDGET, 16) == [1, 0]
    assert _micro_batches(CASES["three samples"], None, 1) == [2, 1]
    assert _micro_batches(CASES["long-tailed"], BUDGET, 16) == [2, 1]
    assert _micro_batches(CASES["long-tailed"], None, 1) == [4, 4 - 1]


@pytest.mark.parametrize("case", list(CASES))
def test_two_fsdp_ranks_score_as_one_process(
    stack: RayEvalStack | RayTrainingStack,
    case: str,
    llama: Path,  # noqa: F811  # the fixture imported above
) -> None:
    from transformers import AutoModelForCausalLM

    samples = _samples(CASES[case])
    assert sequence_lengths(samples) == list(CASES[case])
    one = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    with torch.no_grad():
        want = _log_probs(one, samples, TINY["vocab_size"])
    got = stack.forward(samples)
    assert isinstance(got, ForwardRows)
    kind = "eval" if isinstance(stack, RayEvalStack) else "train"
    assert (got.sequence_tokens, got.padded_tokens) == (sum(CASES[case]), POSITIONS[kind][case])
    assert len(got) == len(want)
    for row, expected in zip(got, want, strict=True):
        assert row == pytest.approx(expected, abs=1e-5)
    assert stack.forward([]) == []
