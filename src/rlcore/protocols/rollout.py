"""The rollout seam: the rollout function, what it is given and what it returns.

:class:`RolloutFn` (slime's rollout function, ``--rollout-function-path``) turns prompts into the
groups one rollout trains on; its values (:class:`RolloutContext`, :class:`RolloutOutput`,
:class:`DynamicSampling`, :data:`Group`) are here beside it, since they are its contract and
everything that runs or writes a rollout function shares them, as are the pieces a context hands
it: the prompt stream (:class:`PromptSource`), the reward (:class:`RewardFn`) and dynamic
sampling's judge (:class:`GroupFilter`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Protocol

import attrs

from rlcore.protocols.engine import RolloutEngine
from rlcore.samples import Generation, Prompt, Sample, SamplingParams

__all__ = [
    "DEFAULT_MAX_ROUNDS",
    "DynamicSampling",
    "Group",
    "GroupFilter",
    "PromptSource",
    "RewardFn",
    "RolloutContext",
    "RolloutFn",
    "RolloutOutput",
]


class RewardFn(Protocol):
    """Scores one generation for one prompt. ``prompt.label`` holds the reference answer.

    The parameters are positional-only: any callable taking a prompt and a generation fits,
    whatever it names them (``def reward(p, g)``)."""

    def __call__(self, prompt: Prompt, generation: Generation, /) -> float: ...


class PromptSource(Protocol):
    """Where a rollout draws its prompts from (the run's
    :class:`~rlcore.data.sampler.PromptSampler`)."""

    def take(self, n: int) -> tuple[Prompt, ...]:
        """The next ``n`` prompts of the run's stream. Its position is what checkpoints record,
        so resuming continues the stream exactly."""
        ...


class GroupFilter(Protocol):
    """Dynamic sampling's judge (``--dynamic-sampling-filter-path``): whether a prompt's group of
    scored samples is worth training on (DAPO drops groups whose rewards all equal, as their
    group-normalised advantages are all 0)."""

    def __call__(self, group: Sequence[Sample], /) -> bool: ...


class RolloutFn(Protocol):
    """The rollout seam (slime's rollout function, ``--rollout-function-path``): everything that
    turns prompts into the groups one rollout trains on.

    It receives a :class:`RolloutContext` (rollout id, prompt source, engine,
    reward function, sampling parameters, the groups wanted, dynamic-sampling settings and the
    groups carried over from the previous rollout) and returns a
    :class:`RolloutOutput`: exactly ``ctx.batch_size`` groups of
    ``ctx.n_samples_per_prompt`` scored samples each, metrics, and any surplus groups to carry
    to the next rollout. The default is :func:`rlcore.rollout.default_rollout` (generate, reward,
    filter, top up). The loop checks the counts and raises
    :class:`~rlcore.errors.RolloutError` naming the function when they are wrong.
    """

    def __call__(self, ctx: RolloutContext, /) -> RolloutOutput: ...


Group = tuple[Sample, ...]
"""One prompt's scored samples (``n_samples_per_prompt`` of them)."""

DEFAULT_MAX_ROUNDS: Final = 8
"""Generation rounds one rollout may take (``--dynamic-sampling-max-rounds``)."""


@attrs.frozen
class DynamicSampling:
    """Dynamic sampling's settings as a rollout function sees them: prompts per round, the round
    limit, whether surplus groups are kept, and the loaded group filter (``None``: keep all)."""

    over_sampling_batch_size: int
    max_rounds: int = DEFAULT_MAX_ROUNDS
    keep_surplus: bool = False
    group_filter: GroupFilter | None = None


@attrs.frozen
class RolloutContext:
    """Everything a rollout function is given for rollout ``rollout_id``.

    It should return ``batch_size`` groups of ``n_samples_per_prompt`` samples. ``prompts`` hands
    out the run's prompt stream (what it takes is consumed: checkpoints record the position);
    ``carried`` are the surplus groups the previous rollout returned (already scored and
    filtered; their generations carry the older weight version they were sampled with).
    """

    rollout_id: int
    """Counted from 0, as slime's ``rollout_id``: the run's files, metrics steps and logs call
    this rollout ``rollout_id + 1``."""
    prompts: PromptSource
    engine: RolloutEngine
    reward_fn: RewardFn
    params: SamplingParams
    n_samples_per_prompt: int
    batch_size: int
    sampling: DynamicSampling
    carried: tuple[Group, ...] = ()


@attrs.frozen
class RolloutOutput:
    """A rollout function's result: the groups to train on, ``rollout/...`` metrics to log, and
    surplus groups to hand to the next rollout as ``carried`` (empty to drop them)."""

    groups: tuple[Group, ...]
    metrics: Mapping[str, float] = attrs.field(factory=dict)
    surplus: tuple[Group, ...] = ()
