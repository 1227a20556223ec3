"""Environments for multi-turn episodes: what answers the model between its turns.

An episode (:mod:`rlcore.rollout.multiturn`) alternates the model's turns with an environment's
observations. An :class:`Environment` is built per episode from its prompt by an
:class:`EnvironmentFactory` (``--environment-path module:function``), takes each of the model's
turns and returns a :class:`StepResult`: the observation to append (as *token ids*, so the
conversation stays token-in/token-out: nothing is decoded and re-encoded), an optional reward and
whether the episode is over. The tool-calling environment is
:class:`rlcore.rollout.tools.ToolEnvironment`.

``step`` is a coroutine: the episodes of a rollout run concurrently on one event loop, so an
environment that waits (a tool, a sandbox, a remote service) should ``await`` rather than block.

This module imports only the standard library and attrs.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from rlcore.protocols.tokenizer import ChatTokenizer, Tokenizer
from rlcore.samples import Prompt, Turn

__all__ = ["Environment", "EnvironmentFactory", "StepResult", "observation_ids"]


def observation_ids(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """``text``'s ids as an observation in the middle of a conversation: without the special
    prefix ``tokenizer.encode`` puts in front of a whole text (``<bos>``), which must not appear
    mid-conversation. ``encode_rendered`` where the tokenizer has it (a chat tokenizer), else
    ``encode`` with whatever ``encode("")`` prepends removed."""
    if isinstance(tokenizer, ChatTokenizer):
        return tuple(tokenizer.encode_rendered(text))
    prefix = tokenizer.encode("")
    ids = tokenizer.encode(text)
    return tuple(ids[len(prefix) :] if ids[: len(prefix)] == prefix else ids)


@attrs.frozen
class StepResult:
    """What an environment returns for one model turn.

    ``observation_ids`` are appended to the conversation after the model's turn (empty: nothing
    to append); they must already be in the model's format (a chat template's tool turn, ending
    where the model's next turn begins). ``observation`` is their text, for logs and rewards.
    ``reward`` (``None``: none) adds to the episode's environment reward; ``done`` ends the
    episode (no observation is appended then).
    """

    observation_ids: tuple[int, ...] = ()
    observation: str = ""
    reward: float | None = None
    done: bool = False

    @classmethod
    def of_text(
        cls, tokenizer: Tokenizer, text: str, *, reward: float | None = None, done: bool = False
    ) -> StepResult:
        """An observation given as text, encoded by :func:`observation_ids` (no ``<bos>``)."""
        return cls(observation_ids(tokenizer, text), text, reward, done)


class Environment(Protocol):
    """One episode's environment (built from the prompt by an :class:`EnvironmentFactory`)."""

    async def step(self, turn: Turn, /) -> StepResult:
        """React to the model's turn (``turn.role == "model"``; ``turn.token_ids`` end with the
        stop token when the model emitted one). Exceptions other than cancellation end the
        rollout with a :class:`~rlcore.errors.RolloutError` naming the environment; an
        environment that wants the episode to go on reports problems in the observation."""
        ...


class EnvironmentFactory(Protocol):
    """Builds the environment of one episode from its prompt (``--environment-path``), with the
    run's tokenizer (an environment returns observations as token ids)."""

    def __call__(self, prompt: Prompt, tokenizer: Tokenizer, /) -> Environment: ...
