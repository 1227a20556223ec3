"""Bring your own rollout function: DAPO's soft overlong punishment on top of the default rollout.

A rollout function takes an ``rlcore.RolloutContext`` and returns an ``rlcore.RolloutOutput``
(``rlcore.RolloutFn`` is the protocol; mypy checks this file against it). This one lets
``rlcore.default_rollout`` generate, score, filter and top up, then shapes each sample's reward
with the soft overlong punishment of DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.4): with a
generation budget ``L_max`` (``--rollout-max-response-len``) and a cache zone ``L_cache``::

    R_length(y) = 0                               |y| <= L_max - L_cache
                  ((L_max - L_cache) - |y|) / L_cache    otherwise (down to -1 at L_max)

Use it from the command line with
``--rollout-function-path examples.own_rollout:overlong_penalty_rollout`` (the module on
``PYTHONPATH``), or pass it to ``rlcore.run(..., rollout_fn=overlong_penalty_rollout)``. Run it:
``python examples/own_rollout.py`` (the core loop with rlcore's fake backend and engine).
"""

from __future__ import annotations

from typing import Final

import attrs

import rlcore
from rlcore.testing import FakeBackend, RecordingSink, ScriptedEngine, label_reward

CACHE_LEN: Final = 2
"""``L_cache``: responses within this many tokens of the budget are penalised, linearly."""


def overlong_penalty(length: int, max_len: int, cache_len: int = CACHE_LEN) -> float:
    """DAPO's ``R_length``: 0 up to ``max_len - cache_len`` tokens, then down to -1 at
    ``max_len``."""
    free = max_len - cache_len
    return 0.0 if length <= free else (free - length) / cache_len


def overlong_penalty_rollout(ctx: rlcore.RolloutContext) -> rlcore.RolloutOutput:
    """The default rollout, then each reward plus its overlong penalty.

    The groups were filtered (``--dynamic-sampling-filter-path``) on the unshaped rewards; the
    advantages are computed from the shaped ones. A ``rollout/overlong_penalty`` metric (the mean
    penalty) is logged beside the default metrics.
    """
    out = rlcore.default_rollout(ctx)
    budget = ctx.params.max_new_tokens
    penalties: list[float] = []

    def shaped(sample: rlcore.Sample) -> rlcore.Sample:
        penalty = overlong_penalty(len(sample.response.token_ids), budget)
        penalties.append(penalty)
        return attrs.evolve(sample, reward=sample.reward + penalty)

    groups = tuple(tuple(shaped(s) for s in group) for group in out.groups)
    metrics = {**out.metrics, "rollout/overlong_penalty": sum(penalties) / len(penalties)}
    return rlcore.RolloutOutput(groups=groups, metrics=metrics, surplus=out.surplus)


_typed: rlcore.RolloutFn = overlong_penalty_rollout  # mypy checks the protocol is met


def _script(prompt: rlcore.Prompt, i: int) -> str:
    """Right or wrong, short or long: the fake engine's answers."""
    return prompt.label if i % 2 == 0 else prompt.label + "??????"


def main() -> tuple[rlcore.RunResult, FakeBackend, RecordingSink]:
    """Train 3 rollouts with the fake backend and engine through the real loop."""
    prompts = tuple(
        rlcore.Prompt(index=i, text=f"{i}+1=", token_ids=(1, i + 3), label=str(i + 1))
        for i in range(8)
    )
    flags = [
        "--num-rollout",
        "3",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "8",
        "--rollout-max-response-len",
        "6",
    ]
    backend, sink = FakeBackend(), RecordingSink()
    result = rlcore.run(
        rlcore.plan(rlcore.load_config(flags)),
        backend,
        ScriptedEngine(_script),
        label_reward,
        rlcore.RunData(train_prompts=prompts),
        sink,
        rollout_fn=overlong_penalty_rollout,
    )
    return result, backend, sink


if __name__ == "__main__":
    result, backend, sink = main()
    for step, metrics in sink.records:
        print(
            f"rollout {step}: reward {metrics['rollout/reward']:.3f}, "
            f"overlong penalty {metrics['rollout/overlong_penalty']:.3f}"
        )
