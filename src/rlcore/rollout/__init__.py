"""Rollout machinery: everything that turns prompts into scored groups of samples.

- :mod:`~rlcore.rollout.default`: the default rollout function (generate, reward, filter, top
  up: DAPO's dynamic sampling) and the pieces a custom one reuses; loading the user's rollout
  function and group filter.
- :mod:`~rlcore.rollout.rewards`: the built-in rule rewards, user reward functions (sync or
  async), scoring a batch of samples.
- :mod:`~rlcore.rollout.multiturn`: episodes (the model's turns and an environment's
  observations) batched over one engine; :mod:`~rlcore.rollout.environments` and
  :mod:`~rlcore.rollout.tools` are what an episode talks to.
- :mod:`~rlcore.rollout.replay`: rollouts saved to files and read back (debug replay, carried
  groups in checkpoints).

The seam's own types (:class:`~rlcore.protocols.rollout.RolloutFn`, its context and output) are
shared types in :mod:`rlcore.protocols`, re-exported here. This room imports the shared types
(``errors``, ``samples``, ``specs``, ``weights``, ``protocols``, ``imports``) and nothing else of
rlcore: not the config, the engines or the loop.
"""

from __future__ import annotations

from rlcore.protocols.rollout import (
    DEFAULT_MAX_ROUNDS,
    DynamicSampling,
    Group,
    RolloutContext,
    RolloutOutput,
)
from rlcore.rollout.default import (
    check_reward_nonzero_std,
    check_rollout_output,
    default_rollout,
    generate_groups,
    load_group_filter,
    load_rollout_function,
)

__all__ = [
    "DEFAULT_MAX_ROUNDS",
    "DynamicSampling",
    "Group",
    "RolloutContext",
    "RolloutOutput",
    "check_reward_nonzero_std",
    "check_rollout_output",
    "default_rollout",
    "generate_groups",
    "load_group_filter",
    "load_rollout_function",
]
