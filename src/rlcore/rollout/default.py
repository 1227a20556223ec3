"""The default rollout function, and the pieces a custom one reuses.

A rollout function (:class:`~rlcore.protocols.rollout.RolloutFn`, slime's
``--rollout-function-path``) takes a :class:`~rlcore.protocols.rollout.RolloutContext` and returns a
:class:`~rlcore.protocols.rollout.RolloutOutput`. The default,
:func:`default_rollout`, is DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section
3.2)::

    carried groups -> [round: take prompts -> generate n each -> reward -> filter groups]
                      until batch_size groups passed -> train on batch_size, the rest is surplus

Without a filter and with ``over_sampling_batch_size == batch_size`` it is one round of exactly the
rollout's prompts: generate ``n`` per prompt, score, train on all of it.

The pieces are small public functions (:func:`generate_groups`, :func:`check_reward_nonzero_std`)
so that a custom rollout function can reuse them; multi-turn episodes plug in below, in place of
the engine call of :func:`generate_groups`. :func:`load_rollout_function` and
:func:`load_group_filter` load the user's functions from their flags.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Final

from rlcore.checkpoint_files import rollout_number
from rlcore.errors import RolloutError
from rlcore.imports import load_function
from rlcore.protocols.engine import RolloutEngine
from rlcore.protocols.rollout import (
    Group,
    GroupFilter,
    RewardFn,
    RolloutContext,
    RolloutFn,
    RolloutOutput,
)
from rlcore.rollout.rewards import score_samples
from rlcore.samples import Prompt, Sample, SamplingParams

__all__ = [
    "check_reward_nonzero_std",
    "check_rollout_output",
    "default_rollout",
    "generate_groups",
    "load_group_filter",
    "load_rollout_function",
]

_REWARD_STD_EPS: Final = 1e-6


def check_reward_nonzero_std(group: Sequence[Sample], /) -> bool:
    """The built-in group filter (slime's ``check_reward_nonzero_std``): keep a group unless its
    rewards all equal (population std <= 1e-6). Such a group's GRPO advantages are all 0: it
    costs a training step and teaches nothing (DAPO, arXiv:2503.14476, section 3.2)."""
    rewards = [s.reward for s in group]
    return len(rewards) > 1 and statistics.pstdev(rewards) > _REWARD_STD_EPS


def generate_groups(
    engine: RolloutEngine,
    reward_fn: RewardFn,
    prompts: Sequence[Prompt],
    n: int,
    params: SamplingParams,
) -> list[Group]:
    """One group per prompt: ``n`` generations each (one engine call, each prompt's samples
    consecutive), scored by ``reward_fn``. Raises :class:`~rlcore.errors.RolloutError` when the
    engine breaks its contract (one generation per request)."""
    requests = [p for p in prompts for _ in range(n)]
    generations = engine.generate(requests, params)
    if len(generations) != len(requests):
        raise RolloutError(
            f"rollout engine {type(engine).__name__} returned {len(generations)} generations for "
            f"{len(requests)} requests ({len(prompts)} prompts x {n} samples); an engine must "
            "return exactly one generation per request, in order"
        )
    rewards = score_samples(requests, generations, reward_fn)
    samples = [
        Sample(prompt=p, response=g, reward=r, group=i // n)
        for i, (p, g, r) in enumerate(zip(requests, generations, rewards, strict=True))
    ]
    return [tuple(samples[i : i + n]) for i in range(0, len(samples), n)]


def default_rollout(ctx: RolloutContext) -> RolloutOutput:
    """Generate, reward, filter, top up (module docstring).

    Carried groups count first. Each round takes ``ctx.sampling.over_sampling_batch_size``
    prompts, generates and scores their groups and keeps those ``ctx.sampling.group_filter``
    accepts, until ``ctx.batch_size`` groups passed; the first ``batch_size`` are trained on, the
    others are the surplus (returned only with ``keep_surplus``). Raises
    :class:`~rlcore.errors.RolloutError` after ``max_rounds`` rounds without enough groups.

    Metrics: ``rollout/groups_generated``, ``groups_filtered``, ``groups_kept`` (generated and
    passed, this rollout), ``groups_carried`` (from the previous rollout), ``groups_surplus``
    (passed beyond the batch), ``sampling_rounds``.
    """
    sampling = ctx.sampling
    kept: list[Group] = list(ctx.carried)
    generated = filtered = rounds = 0
    while len(kept) < ctx.batch_size:
        if rounds == sampling.max_rounds:
            raise RolloutError(
                f"rollout {rollout_number(ctx.rollout_id)}: after {rounds} generation rounds only "
                f"{len(kept)} of {ctx.batch_size} groups passed the filter ({generated} generated, "
                f"{filtered} filtered out); raise --dynamic-sampling-max-rounds or "
                "--over-sampling-batch-size, or check the reward and --dynamic-sampling-filter-path"
            )
        rounds += 1
        prompts = ctx.prompts.take(sampling.over_sampling_batch_size)
        for group in generate_groups(
            ctx.engine, ctx.reward_fn, prompts, ctx.n_samples_per_prompt, ctx.params
        ):
            generated += 1
            if sampling.group_filter is None or _passes(sampling.group_filter, group):
                kept.append(group)
            else:
                filtered += 1
    surplus = tuple(kept[ctx.batch_size :])
    metrics = {
        "rollout/groups_generated": float(generated),
        "rollout/groups_filtered": float(filtered),
        "rollout/groups_kept": float(generated - filtered),
        "rollout/groups_carried": float(len(ctx.carried)),
        "rollout/groups_surplus": float(len(surplus)),
        "rollout/sampling_rounds": float(rounds),
    }
    return RolloutOutput(
        groups=tuple(kept[: ctx.batch_size]),
        metrics=metrics,
        surplus=surplus if sampling.keep_surplus else (),
    )


def _passes(group_filter: GroupFilter, group: Group) -> bool:
    try:
        return bool(group_filter(group))
    except Exception as exc:
        name = getattr(group_filter, "__qualname__", type(group_filter).__qualname__)
        raise RolloutError(
            f"group filter {name} raised {type(exc).__name__}: {exc} on the group of prompt "
            f"{group[0].prompt.index if group else '?'}; fix --dynamic-sampling-filter-path"
        ) from exc


def check_rollout_output(output: object, name: str, batch_size: int, n: int) -> RolloutOutput:
    """``output`` if it is what a rollout function must return (``batch_size`` groups of ``n``
    samples), else :class:`~rlcore.errors.RolloutError` naming the function ``name``."""
    if not isinstance(output, RolloutOutput):
        raise RolloutError(
            f"rollout function {name} returned {type(output).__name__}, not a RolloutOutput"
        )
    sizes = [len(g) for g in output.groups]
    if len(sizes) != batch_size or any(size != n for size in sizes):
        raise RolloutError(
            f"rollout function {name} returned {len(sizes)} groups of sizes {sizes[:8]}; the run "
            f"trains on --rollout-batch-size {batch_size} groups of --n-samples-per-prompt {n}"
        )
    return output


def load_rollout_function(path: str) -> RolloutFn:
    """The rollout function ``--rollout-function-path`` names (``module:function``); a
    :class:`~rlcore.errors.ConfigError` naming the flag when it does not load."""
    fn: RolloutFn = load_function(
        path,
        field="rollout.rollout_function_path (--rollout-function-path)",
        arity=1,
        signature="(ctx: rlcore.RolloutContext) -> rlcore.RolloutOutput",
    )
    return fn


def load_group_filter(path: str) -> GroupFilter:
    """The group filter ``--dynamic-sampling-filter-path`` names; a
    :class:`~rlcore.errors.ConfigError` naming the flag when it does not load."""
    fn: GroupFilter = load_function(
        path,
        field="rollout.dynamic_sampling_filter_path (--dynamic-sampling-filter-path)",
        arity=1,
        signature="(group: Sequence[Sample]) -> bool",
    )
    return fn
