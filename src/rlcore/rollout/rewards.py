"""Rewards: the built-in rule rewards, user reward functions, and scoring a batch of samples.

A reward function takes ``(prompt, generation)`` and returns a float; ``prompt.label`` holds the
reference answer. Built-ins are chosen by name (``--rm-type``): ``exact_match`` and ``math``.
A user's own function is loaded from ``module:function``
(``--custom-rm-path``); it may be ``async def``, and :func:`score_samples` then runs the samples
concurrently (one event loop per call), which is what remote reward models and sandboxes need.

Every failure of a reward function surfaces as :class:`~rlcore.errors.RewardError` naming the
sample, raised ``from`` the original exception; a NaN or infinite reward is a failure too.

This module imports only the standard library (``import rlcore`` stays light).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from fractions import Fraction
from typing import Protocol, TypeGuard, TypeVar, final

from rlcore.errors import ConfigError, ConfigProblem, RewardError
from rlcore.protocols.rollout import RewardFn
from rlcore.samples import Generation, Prompt
from rlcore.specs import RewardName

__all__ = [
    "BUILTIN_REWARDS",
    "AsyncReward",
    "AsyncRewardFn",
    "exact_match",
    "extract_math_answer",
    "get_reward_fn",
    "load_custom_reward",
    "math_reward",
    "score_samples",
]

_T = TypeVar("_T")
_EXCERPT = 60


class AsyncRewardFn(Protocol):
    """An ``async def reward(prompt, generation) -> float`` (parameters positional-only, as in
    :class:`~rlcore.protocols.rollout.RewardFn`)."""

    def __call__(self, prompt: Prompt, generation: Generation, /) -> Awaitable[float]: ...


# --------------------------------------------------------------------------------------------
# Built-in rule rewards


def exact_match(prompt: Prompt, generation: Generation) -> float:
    """1.0 when the response text equals the label, ignoring surrounding whitespace, else 0.0."""
    return 1.0 if generation.text.strip() == prompt.label.strip() else 0.0


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def _last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), with nested braces
    balanced; ``None`` when there is none or its braces never close."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def extract_math_answer(text: str) -> str | None:
    """The final answer of a math response: the last ``\\boxed{...}``'s contents, else the last
    number in the text, else ``None``."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _to_number(text: str) -> Fraction | None:
    """Parse ``42``, ``-3.5``, ``1,000``, ``$7``, ``3/4``, ``\\frac{3}{4}``, ``50\\%`` exactly."""
    s = text.strip().strip("$").replace("\\!", "").replace(" ", "")
    s = s.removeprefix("\\$")
    s = s.removesuffix("\\%").removesuffix("%").rstrip(".")
    frac = _FRAC.match(s)
    if frac:
        num, den = _to_number(frac.group(1)), _to_number(frac.group(2))
        return num / den if num is not None and den else None
    if re.fullmatch(r"[-+]?\d+/\d+", s):
        num_text, den_text = s.split("/")
        return Fraction(int(num_text), int(den_text)) if int(den_text) else None
    if _NUMBER.fullmatch(s):
        return Fraction(s.replace(",", ""))
    return None


def _normalise(text: str) -> str:
    return re.sub(r"\s+", "", text).strip("$").rstrip(".")


def math_reward(prompt: Prompt, generation: Generation) -> float:
    """1.0 when the response's final answer (:func:`extract_math_answer`) equals the label, else
    0.0.

    Both sides are compared as exact numbers when both parse as one (so ``0.5``, ``1/2`` and
    ``\\frac{1}{2}`` agree, and ``1,000`` equals ``1000``); otherwise as text with whitespace
    removed. A label written as ``\\boxed{...}`` is unwrapped first.
    """
    answer = extract_math_answer(generation.text)
    if answer is None:
        return 0.0
    label = prompt.label
    boxed_label = _last_boxed(label)
    if boxed_label is not None:
        label = boxed_label
    got, want = _to_number(answer), _to_number(label)
    if got is not None and want is not None:
        return 1.0 if got == want else 0.0
    return 1.0 if _normalise(answer) == _normalise(label) else 0.0


BUILTIN_REWARDS: Mapping[RewardName, RewardFn] = {
    "exact_match": exact_match,
    "math": math_reward,
}
"""The rule rewards ``--rm-type`` chooses from, one per :data:`~rlcore.specs.RewardName`."""


# --------------------------------------------------------------------------------------------
# User reward functions


def _run_coroutine(coro: Coroutine[object, object, _T]) -> _T:
    """Run ``coro`` on a fresh event loop; from inside a running loop, on a worker thread
    (``asyncio.run`` refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlcore-reward") as pool:
        return pool.submit(asyncio.run, coro).result()


@final
class AsyncReward:
    """A :class:`~rlcore.protocols.rollout.RewardFn` made from an ``async`` reward function.

    :func:`score_samples` awaits :meth:`score` for many samples at once; calling the object
    directly scores one sample on a fresh event loop (slow, but correct, for code that expects a
    plain function).
    """

    def __init__(self, fn: AsyncRewardFn, name: str) -> None:
        self.fn = fn
        self.name = name

    async def score(self, prompt: Prompt, generation: Generation) -> float:
        return await self.fn(prompt, generation)

    def __call__(self, prompt: Prompt, generation: Generation) -> float:
        return _run_coroutine(self.score(prompt, generation))

    def __repr__(self) -> str:
        return f"AsyncReward({self.name})"


_CUSTOM_RM = "data.custom_rm_path (--custom-rm-path)"
"""The setting a custom reward comes from (named as the config's problems name it)."""


def _custom_problem(path: str, message: str, hint: str) -> ConfigError:
    return ConfigError([ConfigProblem(_CUSTOM_RM, f"{path!r}: {message}", hint)])


def load_custom_reward(path: str) -> RewardFn:
    """Import ``module:function`` (``--custom-rm-path``) as a reward function.

    The function takes ``(prompt: Prompt, generation: Generation)`` and returns a float; an
    ``async def`` one is wrapped in :class:`AsyncReward` so :func:`score_samples` runs it
    concurrently. Dotted attributes work (``pkg.mod:Scorer.score``). Raises
    :class:`~rlcore.errors.ConfigError` (``--custom-rm-path``) naming the path when it is
    malformed, the module cannot be imported, the attribute is missing, or it is not a callable
    taking two arguments.
    """
    module_name, sep, attr_path = path.partition(":")
    if not sep or not module_name or not attr_path:
        raise _custom_problem(path, "expected 'module:function'", "for example my_rewards:score")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:
        raise _custom_problem(
            path,
            f"cannot import module {module_name!r} ({exc})",
            "check the spelling and that the module is on PYTHONPATH",
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise _custom_problem(
                path,
                f"{module_name} has no attribute {attr_path!r}",
                "check the function name after the colon",
            ) from exc
    if not callable(obj):
        raise _custom_problem(
            path,
            f"{attr_path} is not a function (it is of type {type(obj).__name__})",
            "point at a callable",
        )
    if not _is_reward_fn(obj):
        raise _custom_problem(
            path,
            f"{attr_path} cannot be called as fn(prompt, generation) ({_binding_error(obj)})",
            "give it the signature (prompt: Prompt, generation: Generation) -> float",
        )
    if _is_async_reward_fn(obj):
        return AsyncReward(obj, path)
    return obj


def _binding_error(fn: Callable[..., object]) -> str | None:
    """Why ``fn(prompt, generation)`` cannot bind to ``fn``'s signature, or ``None`` when it can
    (or when there is no signature to read, as for some builtins: then it is trusted)."""
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as exc:
        return str(exc)
    except ValueError:
        return None
    return None


def _is_reward_fn(fn: Callable[..., object]) -> TypeGuard[RewardFn]:
    """``fn`` takes ``(prompt, generation)``. Its result is not known until it runs:
    :func:`score_samples` checks each one is a finite float."""
    return _binding_error(fn) is None


def _is_async_reward_fn(fn: RewardFn) -> TypeGuard[AsyncRewardFn]:
    """``fn`` is an ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(fn.__call__)


def get_reward_fn(rm_type: RewardName = "exact_match", custom_path: str | None = None) -> RewardFn:
    """The reward function a run uses: ``custom_path`` when given (it wins over ``rm_type``,
    as in slime), else the built-in named ``rm_type`` (a name the config check has already
    accepted). Raises :class:`~rlcore.errors.ConfigError` for a bad path."""
    if custom_path:
        return load_custom_reward(custom_path)
    return BUILTIN_REWARDS[rm_type]


# --------------------------------------------------------------------------------------------
# Scoring


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= _EXCERPT else text[: _EXCERPT - 3] + "...")


def _checked(value: object, i: int, prompt: Prompt, generation: Generation, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _sample_error(
            i, prompt, generation, name, f"returned {type(value).__name__} {value!r}, not a float"
        )
    reward = float(value)
    if not math.isfinite(reward):
        raise _sample_error(i, prompt, generation, name, f"returned the non-finite reward {reward}")
    return reward


def _sample_error(
    i: int, prompt: Prompt, generation: Generation, name: str, what: str
) -> RewardError:
    return RewardError(
        f"reward function {name} {what} on sample {i} (prompt index {prompt.index}, "
        f"prompt {_excerpt(prompt.text)}, response {_excerpt(generation.text)}); "
        "fix the reward function or the data for this sample"
    )


def _name(fn: object) -> str:
    if isinstance(fn, AsyncReward):
        return fn.name
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}" if module else str(qualname)


async def _score_all(
    prompts: Sequence[Prompt],
    generations: Sequence[Generation],
    reward_fn: RewardFn | AsyncRewardFn,
    max_concurrency: int,
) -> list[float]:
    name = _name(reward_fn)
    limit = asyncio.Semaphore(max_concurrency)

    async def one(i: int) -> float:
        prompt, generation = prompts[i], generations[i]
        async with limit:
            try:
                if isinstance(reward_fn, AsyncReward):
                    value: object = await reward_fn.score(prompt, generation)
                else:
                    value = reward_fn(prompt, generation)
                    if inspect.isawaitable(value):
                        value = await value
            except Exception as exc:
                raise _sample_error(
                    i, prompt, generation, name, f"raised {type(exc).__name__}: {exc}"
                ) from exc
        return _checked(value, i, prompt, generation, name)

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    if not tasks:
        return []
    await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    failed = [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]
    if failed:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        error = failed[0].exception()
        assert error is not None  # filtered above
        raise error
    return [t.result() for t in tasks]


def score_samples(
    prompts: Sequence[Prompt],
    generations: Sequence[Generation],
    reward_fn: RewardFn | AsyncRewardFn,
    *,
    max_concurrency: int = 64,
) -> list[float]:
    """One reward per ``(prompts[i], generations[i])``, in order.

    Async reward functions (an :class:`AsyncReward`, or any function returning an awaitable) run
    concurrently, at most ``max_concurrency`` at a time, on one event loop created for this call.
    Plain functions run one after the other on that loop. The first failure cancels the rest and
    raises :class:`~rlcore.errors.RewardError` naming the sample (its position, the prompt's
    dataset index, excerpts of prompt and response) ``from`` the original exception; a result that
    is not a finite number is a failure too.
    """
    if len(prompts) != len(generations):
        raise ValueError(
            f"score_samples: {len(prompts)} prompts but {len(generations)} generations; "
            "pass one prompt per generation (repeat a prompt for its samples)"
        )
    if max_concurrency < 1:
        raise ValueError(f"score_samples: max_concurrency must be >= 1, got {max_concurrency}")
    return _run_coroutine(_score_all(prompts, generations, reward_fn, max_concurrency))
