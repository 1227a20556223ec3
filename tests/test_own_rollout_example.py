"""examples/own_rollout.py: a user's rollout function (DAPO's overlong penalty), with the fakes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from rlcore.rollout import load_rollout_function

ROOT = Path(__file__).resolve().parents[1]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "own_rollout", ROOT / "examples" / "own_rollout.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_penalty_is_dapos_soft_overlong_punishment() -> None:
    penalty = _example().overlong_penalty
    # Budget 6, cache 2: free up to 4 tokens, then -1/2 per token, -1 at the budget.
    assert [penalty(n, 6) for n in (0, 4, 5, 6)] == [0.0, 0.0, -0.5, -1.0]


def test_the_rollout_function_shapes_the_rewards_the_actor_trains_on() -> None:
    result, backend, sink = _example().main()
    assert result.trained == (0, 1, 2) and result.rollouts == (0, 1, 2)
    for batch in backend.training_stacks[0].batches:
        for s in batch.samples:
            right = s.response.text == s.prompt.label
            assert s.reward == (1.0 if right else -1.0)  # the long wrong answers hit the budget
    for _, metrics in sink.records:
        assert metrics["rollout/overlong_penalty"] == pytest.approx(-0.5)
        assert metrics["rollout/groups_generated"] == 4.0  # the default rollout's metrics too


def test_the_flag_loads_it_by_path() -> None:
    fn = load_rollout_function("examples.own_rollout:overlong_penalty_rollout")
    assert getattr(fn, "__qualname__", None) == "overlong_penalty_rollout"
