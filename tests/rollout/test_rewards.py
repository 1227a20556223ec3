"""Built-in rule rewards, custom reward loading and concurrent scoring."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlcore.config.flags import load_config
from rlcore.errors import ConfigError, RewardError
from rlcore.rollout.rewards import (
    BUILTIN_REWARDS,
    AsyncReward,
    exact_match,
    extract_math_answer,
    get_reward_fn,
    load_custom_reward,
    math_reward,
    score_samples,
)
from rlcore.samples import Generation, Prompt
from rlcore.specs import RewardName


def P(label: str, text: str = "q", index: int = 0) -> Prompt:
    return Prompt(index=index, text=text, token_ids=(1,), label=label)


def G(text: str) -> Generation:
    return Generation(token_ids=(), log_probs=(), text=text)


def test_exact_match_strips_whitespace() -> None:
    assert exact_match(P("46"), G(" 46\n")) == 1.0
    assert exact_match(P(" 46 "), G("46")) == 1.0
    assert exact_match(P("46"), G("46.")) == 0.0


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{a_{b_{c}}} done", "a_{b_{c}}"),
        ("x = 3, y = -4.5 and that's it", "-4.5"),
        ("total 1,234 apples", "1,234"),
        (r"\boxed{unclosed 7", "7"),
        ("no numbers here", None),
    ],
)
def test_extract_math_answer(text: str, answer: str | None) -> None:
    assert extract_math_answer(text) == answer


@pytest.mark.parametrize(
    ("label", "text", "reward"),
    [
        ("42", r"The answer is \boxed{42}", 1.0),
        ("42", r"\boxed{42.0}", 1.0),
        ("0.5", r"\boxed{\frac{1}{2}}", 1.0),
        ("1/2", r"\boxed{\dfrac{1}{2}}", 1.0),
        ("1000", "so 1,000", 1.0),
        ("-3", "we get -3", 1.0),
        ("42", "41 plus 1 is 43", 0.0),
        ("42", r"\boxed{42} but the last number is 7", 1.0),  # boxed wins over the last number
        ("42", "no answer", 0.0),
        (r"\boxed{7}", "it is 7", 1.0),
        ("x+1", r"\boxed{x + 1}", 1.0),
        ("x+1", r"\boxed{x + 2}", 0.0),
        ("50", r"\boxed{50\%}", 1.0),
    ],
)
def test_math_reward(label: str, text: str, reward: float) -> None:
    assert math_reward(P(label), G(text)) == reward


def test_get_reward_fn_by_name() -> None:
    assert set(BUILTIN_REWARDS) == set(typing.get_args(RewardName)) == {"exact_match", "math"}
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("exact_match", None) is exact_match


def test_an_unknown_reward_name_is_a_config_error_before_any_data_is_read() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            ["--num-rollout", "0", "--eval-prompt-data", "x", "x.jsonl", "--rm-type", "mth"]
        )
    assert [p.path for p in info.value.problems] == ["data.rm_type (--rm-type)"]
    assert "'exact_match', 'math'" in str(info.value)


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"user_rewards_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import asyncio

            def length(prompt, generation):
                return float(len(generation.text))

            async def slow_length(prompt, generation):
                await asyncio.sleep(0.05)
                return float(len(generation.text))

            class Scorer:
                @staticmethod
                def score(prompt, generation):
                    return 2.0

            NOT_CALLABLE = 3

            def one_arg(prompt):
                return 1.0
            """
        ),
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_load_custom_reward(reward_module: str) -> None:
    fn = load_custom_reward(f"{reward_module}:length")
    assert fn(P("x"), G("abc")) == 3.0
    assert load_custom_reward(f"{reward_module}:Scorer.score")(P("x"), G("")) == 2.0
    slow = get_reward_fn("exact_match", f"{reward_module}:slow_length")  # the custom path wins
    assert isinstance(slow, AsyncReward)
    assert slow(P("x"), G("ab")) == 2.0  # callable directly, too


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        (":nope", "has no attribute 'nope'"),
        (":NOT_CALLABLE", r"NOT_CALLABLE is not a function \(it is of type int\)"),
        (":one_arg", r"cannot be called as fn\(prompt, generation\)"),
        ("", "expected 'module:function'"),
    ],
)
def test_bad_custom_reward_paths(reward_module: str, suffix: str, message: str) -> None:
    path = reward_module + suffix
    with pytest.raises(
        ConfigError, match=rf"custom_rm_path \(--custom-rm-path\): '{path}': .*{message}"
    ):
        load_custom_reward(path)


def test_missing_custom_module() -> None:
    with pytest.raises(
        ConfigError, match=r"'no_such_mod_xyz:f': cannot import module 'no_such_mod_xyz'"
    ):
        load_custom_reward("no_such_mod_xyz:f")


def test_score_samples_sync_in_order() -> None:
    prompts = [P("1", index=i) for i in range(5)]
    gens = [G("1" * i) for i in range(5)]
    assert score_samples(prompts, gens, exact_match) == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert score_samples([], [], exact_match) == []
    with pytest.raises(ValueError, match="2 prompts but 1 generations"):
        score_samples(prompts[:2], gens[:1], exact_match)


def test_score_samples_runs_async_rewards_concurrently(reward_module: str) -> None:
    fn = load_custom_reward(f"{reward_module}:slow_length")
    prompts = [P("x", index=i) for i in range(40)]
    gens = [G("a" * i) for i in range(40)]
    start = time.perf_counter()
    rewards = score_samples(prompts, gens, fn)
    elapsed = time.perf_counter() - start
    assert rewards == [float(i) for i in range(40)]
    assert elapsed < 1.0  # 40 x 50 ms one after the other would take 2 s
    start = time.perf_counter()
    score_samples(prompts[:6], gens[:6], fn, max_concurrency=2)
    assert time.perf_counter() - start >= 0.14  # three rounds of two


def test_score_samples_accepts_a_bare_async_function() -> None:
    async def reward(prompt: Prompt, generation: Generation) -> float:
        await asyncio.sleep(0)
        return 0.5

    assert score_samples([P("a")], [G("b")], reward) == [0.5]


def test_score_samples_works_inside_a_running_loop() -> None:
    async def main() -> list[float]:
        return score_samples([P("a")], [G("a")], exact_match)

    assert asyncio.run(main()) == [1.0]


def test_reward_errors_name_the_sample() -> None:
    def boom(prompt: Prompt, generation: Generation) -> float:
        if generation.text == "bad":
            raise KeyError("missing field")
        return 1.0

    prompts = [P("1", text="first prompt", index=10), P("1", text="what is 2+2?", index=11)]
    with pytest.raises(RewardError) as info:
        score_samples(prompts, [G("ok"), G("bad")], boom)
    message = str(info.value)
    assert "on sample 1 (prompt index 11" in message
    assert "'what is 2+2?'" in message and "response 'bad'" in message
    assert "KeyError" in message and "boom" in message
    assert isinstance(info.value.__cause__, KeyError)


def test_async_reward_errors_cancel_the_rest() -> None:
    finished: list[int] = []

    async def reward(prompt: Prompt, generation: Generation) -> float:
        if prompt.index == 0:
            raise ValueError("server said no")
        await asyncio.sleep(5)
        finished.append(prompt.index)
        return 1.0

    start = time.perf_counter()
    with pytest.raises(RewardError, match="ValueError: server said no on sample 0") as info:
        score_samples([P("x", index=i) for i in range(3)], [G("y")] * 3, reward)
    assert time.perf_counter() - start < 2
    assert finished == []
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None, "1.0", True])
def test_non_finite_or_non_numeric_rewards_are_errors(value: object) -> None:
    def reward(prompt: Prompt, generation: Generation) -> float:
        return value  # type: ignore[return-value]  # deliberately wrong

    with pytest.raises(RewardError, match="sample 0 .*"):
        score_samples([P("x")], [G("y")], reward)


def test_long_excerpts_are_cut() -> None:
    def reward(prompt: Prompt, generation: Generation) -> float:
        raise RuntimeError("x")

    with pytest.raises(RewardError) as info:
        score_samples([P("x", text="p" * 500)], [G("r" * 500)], reward)
    assert "p" * 500 not in str(info.value) and "..." in str(info.value)
