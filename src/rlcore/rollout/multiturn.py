"""Multi-turn episodes: one sample = the model's turns and an environment's observations.

Where it plugs in: below the rollout function, in place of its engine call. An episode is one
:class:`~rlcore.samples.Generation` per prompt, exactly what the
:class:`~rlcore.protocols.engine.RolloutEngine` contract returns, so :class:`EpisodeEngine` wraps
the rollout engine and the rollout seam is unchanged (the default rollout function, dynamic
sampling, custom rollout functions, evaluation and rollout-only runs all get episodes). It runs
one coroutine per request (the generate function: :func:`run_episode`, or the user's
``--custom-generate-function-path module:fn``, slime's flag) concurrently on one event loop, and
a :class:`BatchingEngine` gathers the turns the episodes ask for into one ``engine.generate``
call per step: the embedded engine is synchronous and batch-oriented, and SGLang receives the
step's requests together. :func:`with_env_reward` lets the environment's reward replace or add
to the reward function's (``--env-reward``).

Token-in/token-out: an episode's context is a list of token ids, the prompt's then each turn's.
The engine continues from exactly those ids (the embedded engine and SGLang's ``/generate`` with
``input_ids``); observations come from the environment as ids; nothing is decoded and re-encoded.
The :class:`~rlcore.samples.Generation` an episode returns holds the response ids (all turns), a
loss mask (1 on the model's tokens, 0 on observations), the engine's log-probs (0.0 on
observations), the turns themselves and the environment's reward. The trainer scores
``prompt.token_ids + response.token_ids``: the ids the engine saw.

Budgets: ``params.max_new_tokens`` (``--rollout-max-response-len``) counts every response token,
the model's and the observations'; ``max_turns`` (``--max-turns``) counts model turns. An episode
that runs out of either is *truncated*: ``finish_reason="length"`` (a finished one has
``"stop"``), and an observation that does not fit is cut to the budget.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, final

import attrs

from rlcore.errors import RLCoreError, RolloutError
from rlcore.imports import load_function
from rlcore.protocols.engine import (
    RolloutEngine,
    keep_weight_source,
    receive_weights_midway,
    takes_weights_midway,
)
from rlcore.protocols.rollout import RewardFn
from rlcore.protocols.tokenizer import Tokenizer
from rlcore.rollout.environments import EnvironmentFactory, StepResult
from rlcore.rollout.rewards import AsyncReward, AsyncRewardFn, _run_coroutine
from rlcore.samples import FinishReason, Generation, Prompt, SamplingParams, Turn
from rlcore.specs import EnvRewardMode
from rlcore.weights import WeightSink, WeightSource

__all__ = [
    "BatchingEngine",
    "CustomGenerateFn",
    "EnvRewardMode",
    "EpisodeEngine",
    "GenerateContext",
    "load_custom_generate_function",
    "load_environment_factory",
    "run_episode",
    "with_env_reward",
]


@final
class BatchingEngine:
    """Turns concurrent per-episode requests into batched ``engine.generate`` calls.

    An episode awaits :meth:`generate`; the request waits until every episode that is ready has
    asked (the event loop has nothing else to run), then all of them go to the engine in one call
    sampled with ``params`` and the largest of their token budgets, and each result is cut to its
    own budget. Cutting a sample at ``n`` tokens is distributed exactly as sampling at most ``n``
    (tokens are drawn left to right), so batching does not change what an episode sees.
    """

    def __init__(
        self, engine: RolloutEngine, params: SamplingParams, decode: Callable[[Sequence[int]], str]
    ) -> None:
        self.engine = engine
        self.params = params
        self._decode = decode
        self._pending: list[tuple[Prompt, int, asyncio.Future[Generation]]] = []
        self._flush: asyncio.Task[None] | None = None
        self.calls = 0
        """``engine.generate`` calls made so far."""
        self.requests = 0
        """Turns generated so far."""

    async def generate(self, prompt: Prompt, max_new_tokens: int) -> Generation:
        """Continue ``prompt.token_ids`` (the conversation so far) with at most ``max_new_tokens``
        tokens sampled with :attr:`params`; the engine's :class:`Generation`."""
        if max_new_tokens < 1:
            raise ValueError(f"BatchingEngine.generate: max_new_tokens {max_new_tokens} < 1")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._pending.append((prompt, max_new_tokens, future))
        if self._flush is None:
            self._flush = asyncio.ensure_future(self._flush_when_idle())
        return await future

    async def _flush_when_idle(self) -> None:
        # Let every runnable episode reach its next request: stop when a pass adds none.
        seen = -1
        while seen != len(self._pending):
            seen = len(self._pending)
            for _ in range(3):
                await asyncio.sleep(0)
        batch, self._pending, self._flush = self._pending, [], None
        budget = max(n for _, n, _ in batch)
        try:
            generations = self.engine.generate(
                [p for p, _, _ in batch], attrs.evolve(self.params, max_new_tokens=budget)
            )
            if len(generations) != len(batch):
                raise RolloutError(
                    f"rollout engine {type(self.engine).__name__} returned {len(generations)} "
                    f"generations for {len(batch)} requests"
                )
        except BaseException as exc:
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        self.calls += 1
        self.requests += len(batch)
        for (_, n, future), gen in zip(batch, generations, strict=True):
            if not future.done():
                future.set_result(self._cut(gen, n))

    def _cut(self, gen: Generation, n: int) -> Generation:
        if len(gen.token_ids) <= n:
            return gen
        ids = gen.token_ids[:n]
        return attrs.evolve(
            gen,
            token_ids=ids,
            log_probs=gen.log_probs[:n],
            text=self._decode(ids),
            finish_reason="length",
        )


@attrs.frozen
class GenerateContext:
    """What a generate function gets for one sample.

    ``engine`` generates a turn from the conversation's token ids (batched with the other
    episodes' turns); ``params`` are the rollout's sampling parameters, whose ``max_new_tokens``
    is the episode's whole response budget; ``tokenizer`` decodes and encodes;
    ``make_environment`` is ``--environment-path``'s factory (``None`` when not given);
    ``max_turns`` is ``--max-turns``.
    """

    engine: BatchingEngine
    params: SamplingParams
    tokenizer: Tokenizer
    max_turns: int
    make_environment: EnvironmentFactory | None = None


class CustomGenerateFn(Protocol):
    """``--custom-generate-function-path``: generates one sample (slime's custom generate
    function). Must return a :class:`Generation` whose ``token_ids`` continue
    ``prompt.token_ids`` and, for a multi-turn episode, a ``loss_mask`` with 0 on the tokens the
    model did not generate (and 0.0 log-probs there)."""

    async def __call__(self, ctx: GenerateContext, prompt: Prompt, /) -> Generation: ...


async def run_episode(ctx: GenerateContext, prompt: Prompt) -> Generation:
    """The default generate function: the model and ``ctx.make_environment(prompt)`` take turns.

    Model turn (the engine continues the conversation's ids) -> the environment's step -> its
    observation ids are appended -> next model turn, until the environment says ``done``, the
    model stops without a stop token (out of budget), ``ctx.max_turns`` model turns were taken or
    the response budget is spent (module docstring). The environment's rewards are summed.
    """
    if ctx.make_environment is None:
        raise RolloutError(
            "multi-turn rollout without an environment: pass --environment-path module:function "
            "(a factory building an rlcore.rollout.environments.Environment from a prompt), or a "
            "--custom-generate-function-path"
        )
    try:
        env = ctx.make_environment(prompt, ctx.tokenizer)
    except Exception as exc:
        raise RolloutError(
            f"environment factory {_name(ctx.make_environment)} raised {type(exc).__name__}: "
            f"{exc} for prompt {prompt.index}; fix --environment-path (a factory "
            "(prompt, tokenizer) -> Environment)"
        ) from exc
    budget = ctx.params.max_new_tokens
    ids: list[int] = []
    log_probs: list[float] = []
    mask: list[int] = []
    turns: list[Turn] = []
    env_reward: float | None = None
    finish: FinishReason = "length"
    version = 0
    first_version: int | None = None
    for turn_index in range(ctx.max_turns):
        context = attrs.evolve(prompt, token_ids=prompt.token_ids + tuple(ids))
        gen = await ctx.engine.generate(context, budget - len(ids))
        version = gen.weight_version
        if first_version is None:
            first_version = gen.first_weight_version
        ids.extend(gen.token_ids)
        log_probs.extend(gen.log_probs)
        mask.extend([1] * len(gen.token_ids))
        model_turn = Turn("model", gen.token_ids, gen.text)
        turns.append(model_turn)
        if gen.finish_reason != "stop":
            break  # out of budget mid-turn: truncated
        try:
            result = await env.step(model_turn)
        except RLCoreError:
            raise
        except Exception as exc:
            raise RolloutError(
                f"environment {_name(type(env))}.step raised {type(exc).__name__}: {exc} at turn "
                f"{turn_index} of prompt {prompt.index}; report tool problems as observations"
            ) from exc
        if not isinstance(result, StepResult):
            raise RolloutError(
                f"environment {_name(type(env))}.step returned "
                f"{type(result).__name__} {str(result)[:80]!r} at turn {turn_index} of prompt "
                f"{prompt.index}, not a StepResult; return "
                "rlcore.rollout.environments.StepResult(observation_ids, observation, reward, "
                "done), or StepResult.of_text(tokenizer, text)"
            )
        if result.reward is not None:
            env_reward = (env_reward or 0.0) + result.reward
        if result.done:
            finish = "stop"
            break
        if turn_index + 1 == ctx.max_turns:
            break  # no model turn follows: the observation would be trained on by no one
        room = budget - len(ids)
        obs = result.observation_ids[:room]
        if obs:
            ids.extend(obs)
            log_probs.extend([0.0] * len(obs))
            mask.extend([0] * len(obs))
            text = result.observation if len(obs) == len(result.observation_ids) else ""
            turns.append(Turn("environment", obs, text or ctx.tokenizer.decode(obs)))
        if len(obs) < len(result.observation_ids) or len(ids) >= budget:
            break  # the observation did not fit, or nothing is left for the model
    return Generation(
        token_ids=tuple(ids),
        log_probs=tuple(log_probs),
        text=ctx.tokenizer.decode(ids),
        finish_reason=finish,
        weight_version=version,
        loss_mask=tuple(mask),
        turns=tuple(turns),
        env_reward=env_reward,
        first_weight_version=version if first_version is None else first_version,
    )


@final
class EpisodeEngine:
    """A :class:`~rlcore.protocols.engine.RolloutEngine` whose generations are episodes.

    ``generate`` turns every prompt into an episode of ``generate_fn`` (default
    :func:`run_episode`) against ``engine``; all of a call's episodes run concurrently and their
    turns are batched (:class:`BatchingEngine`). An episode is still one
    :class:`~rlcore.samples.Generation` per prompt, so the rollout seam needs no second path:
    the rollout function (default or ``--rollout-function-path``), dynamic sampling, evaluation
    and rollout-only runs all produce episodes when given this engine. Weight updates and
    ``close`` go to ``engine``.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Tokenizer,
        *,
        max_turns: int,
        make_environment: EnvironmentFactory | None = None,
        generate_fn: CustomGenerateFn | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"EpisodeEngine: max_turns must be >= 1, got {max_turns}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.make_environment = make_environment
        self.generate_fn: CustomGenerateFn = generate_fn if generate_fn is not None else run_episode
        self.engine_calls = 0
        """``engine.generate`` calls made by the last :meth:`generate` (one per batched step)."""

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        batching = BatchingEngine(self.engine, params, self.tokenizer.decode)
        ctx = GenerateContext(
            batching, params, self.tokenizer, self.max_turns, self.make_environment
        )
        generations = _run_coroutine(self._all(ctx, prompts))
        self.engine_calls = batching.calls
        return generations

    def receive_weights(self, version: int) -> AbstractContextManager[Sequence[WeightSink]]:
        return self.engine.receive_weights(version)

    @property
    def interrupts_generation(self) -> bool:
        """Whether the wrapped engine takes weights mid-generation (partial rollouts)."""
        return takes_weights_midway(self.engine)

    def receive_weights_interrupting(
        self, version: int
    ) -> AbstractContextManager[Sequence[WeightSink]]:
        return receive_weights_midway(self.engine, version)

    def restore_weights_from(self, source: WeightSource | None) -> None:
        """Passed on to the wrapped engine when it restarts servers."""
        keep_weight_source(self.engine, source)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def close(self) -> None:
        self.engine.close()

    async def _all(self, ctx: GenerateContext, prompts: Sequence[Prompt]) -> list[Generation]:
        tasks = [asyncio.ensure_future(self._one(ctx, p)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _one(self, ctx: GenerateContext, prompt: Prompt) -> Generation:
        try:
            gen = await self.generate_fn(ctx, prompt)
        except RLCoreError:
            raise
        except Exception as exc:
            raise RolloutError(
                f"generate function {_name(self.generate_fn)} raised {type(exc).__name__}: {exc} "
                f"for prompt {prompt.index}; fix --custom-generate-function-path"
            ) from exc
        if not isinstance(gen, Generation):
            raise RolloutError(
                f"generate function {_name(self.generate_fn)} returned {type(gen).__name__} for "
                f"prompt {prompt.index}, not an rlcore.samples.Generation"
            )
        limit = ctx.params.max_new_tokens
        if len(gen.token_ids) > limit:
            raise RolloutError(
                f"generate function {_name(self.generate_fn)} returned {len(gen.token_ids)} "
                f"response tokens for prompt {prompt.index}; --rollout-max-response-len is {limit}"
            )
        return gen


def with_env_reward(reward_fn: RewardFn | AsyncRewardFn, mode: EnvRewardMode) -> RewardFn:
    """The reward to train on (``--env-reward``): ``reward_fn``'s (``ignore``: returned as is),
    the episode's environment reward instead (``replace``; an episode whose environment gave none
    scores 0.0), or their sum (``add``). The result scores concurrently like ``reward_fn``."""
    if mode == "ignore":
        return reward_fn  # type: ignore[return-value]  # an AsyncReward is a RewardFn too
    inner = reward_fn

    async def combined(prompt: Prompt, generation: Generation) -> float:
        env = generation.env_reward if generation.env_reward is not None else 0.0
        if mode == "replace":
            return env
        if isinstance(inner, AsyncReward):
            base = await inner.score(prompt, generation)
        else:
            result = inner(prompt, generation)
            base = await result if inspect.isawaitable(result) else result
        return float(base) + env

    return AsyncReward(combined, f"{_name(inner)} with --env-reward {mode}")


def _name(fn: object) -> str:
    """``module.qualname`` of a user's function or class (of its type, for other objects)."""
    owner = fn if hasattr(fn, "__qualname__") else type(fn)
    module = getattr(owner, "__module__", None)
    return f"{module}.{owner.__qualname__}" if module else str(owner.__qualname__)


def load_custom_generate_function(path: str) -> CustomGenerateFn:
    """The coroutine function ``--custom-generate-function-path`` names."""
    fn: CustomGenerateFn = load_function(
        path,
        field="multiturn.custom_generate_function_path (--custom-generate-function-path)",
        arity=2,
        signature=(
            "async (ctx: rlcore.rollout.multiturn.GenerateContext, prompt: Prompt) -> Generation"
        ),
    )
    return fn


def load_environment_factory(path: str) -> EnvironmentFactory:
    """The environment factory ``--environment-path`` names."""
    fn: EnvironmentFactory = load_function(
        path,
        field="multiturn.environment_path (--environment-path)",
        arity=2,
        signature=(
            "(prompt: Prompt, tokenizer: Tokenizer) -> rlcore.rollout.environments.Environment"
        ),
    )
    return fn
