"""The padding fraction of each forward-only pass (#37): a stack's ``forward`` says the positions
it ran (:class:`~rlcore.samples.ForwardRows`, which survives Ray's pickling and sums over the
data-parallel ranks that shared a pass), and the loop reports each pass's share of padding as
``perf/NAME_padding`` and all passes' as ``perf/forward_padding``; a stack that returns a plain
list keeps working, without the metric."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Final, final

import pytest

from rlcore.config import load_config
from rlcore.loop.plan import TrainPlan, plan
from rlcore.loop.stages import TrainStacks, build_stacks, make_train_batch
from rlcore.protocols.stacks import EvalStack, TrainingStack
from rlcore.samples import ForwardRows, Generation, Prompt, Sample
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore.testing import FakeBackend, FakeEvalStack
from rlcore.weights import WeightSink

RESPONSES: Final = (28, 2, 3, 2, 3, 2, 3, 2)
"""A long-tailed batch: one long answer, seven short ones (prompts of two tokens)."""
LENGTHS: Final = [2 + n for n in RESPONSES]
TOKENS: Final = sum(LENGTHS)
PASSES: Final = ("actor_logprobs", "ref_logprobs", "critic_values", "teacher_logprobs")


def _samples() -> list[Sample]:
    return [
        Sample(
            Prompt(i, "", (1, 3 + i)),
            Generation(tuple(4 for _ in range(n)), tuple(-1.0 for _ in range(n)), "stop"),
            float(i % 2),
            i // 2,
        )
        for i, n in enumerate(RESPONSES)
    ]


def _plan(*extra: str) -> TrainPlan:
    flags = [
        *("--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2"),
        *("--global-batch-size", "8", "--micro-batch-size", "2"),
        *("--advantage-estimator", "ppo", "--kl-coef", "0.01"),  # critic, old and ref log-probs
        *("--use-opd", "--opd-teacher-hf-checkpoint", "teacher"),
        *extra,
    ]
    the_plan = plan(load_config(flags))
    assert isinstance(the_plan, TrainPlan)
    return the_plan


def _scored(the_plan: TrainPlan, stacks: TrainStacks | None = None) -> dict[str, float]:
    stacks = stacks or build_stacks(the_plan, FakeBackend())
    _, metrics = make_train_batch(_samples(), stacks, the_plan, 0)
    return metrics


def test_each_pass_reports_the_share_of_its_positions_that_were_padding() -> None:
    """Padded to the batch's longest sequence (the fakes' micro-batches of 16), 1 - 61/240 for
    every pass; the reference in micro-batches of 4 sequences pads the long answer's three
    short neighbours alone; the total weighs each pass by the positions it ran."""
    assert (LENGTHS, TOKENS) == ([30, 4, 5, 4, 5, 4, 5, 4], 61)
    the_plan = _plan()
    backend = FakeBackend()
    stacks = build_stacks(the_plan, backend)
    (reference,) = [s for s in backend.eval_stacks if s.spec.role == "reference"]
    reference.forward_micro_batch = 4
    metrics = _scored(the_plan, stacks)
    padded = 1 - 61 / 240
    for name in PASSES:
        assert metrics[f"perf/{name}_tokens_per_sec"] > 0
        want = 1 - 61 / (4 * 30 + 4 * 5) if name == "ref_logprobs" else padded
        assert metrics[f"perf/{name}_padding"] == pytest.approx(want), name
    assert metrics["perf/forward_padding"] == pytest.approx(1 - 4 * 61 / (3 * 240 + 140))


def test_with_a_token_budget_the_fakes_run_packed_sequences() -> None:
    """``--use-dynamic-batch-size``: the fakes pack (no padding, as packed sequences on a GPU
    run); the real backends' budget micro-batches are in the conformance suite."""
    metrics = _scored(_plan("--use-dynamic-batch-size", "--max-tokens-per-gpu", "32"))
    for name in PASSES:
        assert metrics[f"perf/{name}_padding"] == 0.0
    assert metrics["perf/forward_padding"] == 0.0


@final
class _PlainList:
    """An eval stack whose ``forward`` returns a plain list (as an own backend's may): it says
    nothing of the positions it ran."""

    kind: Final = "eval"

    def __init__(self, stack: FakeEvalStack) -> None:
        self._stack = stack

    @property
    def spec(self) -> ModelSpec:
        return self._stack.spec

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return list(self._stack.forward(samples))

    def load(self, path: Path) -> int:
        return self._stack.load(path)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        self._stack.send_weights(sinks)


@final
class _Silent:
    """Fake stacks, the reference a :class:`_PlainList`."""

    def __init__(self) -> None:
        self.inner = FakeBackend()

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack:
        return self.inner.build_training_stack(spec)

    def build_eval_stack(self, spec: EvalSpec) -> EvalStack:
        stack = self.inner.build_eval_stack(spec)
        return _PlainList(stack) if spec.model.role == "reference" else stack


def test_a_stack_that_says_nothing_of_its_positions_has_no_padding_metric() -> None:
    the_plan = _plan()
    metrics = _scored(the_plan, build_stacks(the_plan, _Silent()))
    assert metrics["perf/ref_logprobs_tokens_per_sec"] > 0
    assert "perf/ref_logprobs_padding" not in metrics
    assert metrics["perf/actor_logprobs_padding"] == pytest.approx(1 - 61 / 240)
    assert metrics["perf/forward_padding"] == pytest.approx(1 - 61 / 240)  # those that say


def test_forward_rows_are_a_list_that_keeps_its_counts_through_pickling() -> None:
    rows = ForwardRows([(1.0,), (2.0, 3.0)], sequence_tokens=7, padded_tokens=10)
    assert rows == [(1.0,), (2.0, 3.0)] and isinstance(rows, list)
    back = pickle.loads(pickle.dumps(rows))
    assert back == rows and (back.sequence_tokens, back.padded_tokens) == (7, 10)
    assert isinstance(back, ForwardRows)
    with pytest.raises(ValueError, match="7 tokens cannot take 5 positions"):
        ForwardRows([], sequence_tokens=7, padded_tokens=5)


def test_joined_rows_sum_the_counts_of_every_part_that_says_them() -> None:
    """How the launcher puts data-parallel ranks' results together: the positions sum over the
    ranks (an idle rank's throwaway pass included); one rank's plain list, and nothing is said."""
    parts = [
        ForwardRows([(1.0,)], sequence_tokens=3, padded_tokens=4),
        ForwardRows([], sequence_tokens=0, padded_tokens=1),
    ]
    joined = ForwardRows.joined([(1.0,)], parts)
    assert isinstance(joined, ForwardRows)
    assert (joined.sequence_tokens, joined.padded_tokens) == (3, 5)
    assert joined == [(1.0,)]
    plain = ForwardRows.joined([(1.0,)], [parts[0], []])
    assert type(plain) is list and plain == [(1.0,)]
