"""Multi-turn episodes, the tool environment and the batching of turns, against scripted engines.

The engine here is :class:`rlcore.testing.ScriptedEngine` (tokens are code points) and the
tokenizer a code-point one, so every id can be checked by hand. The real engines are exercised in
tests/engines/test_multiturn_embedded.py, tests/e2e and tests/sglang.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from rlcore.errors import RolloutError
from rlcore.rollout import generate_groups
from rlcore.rollout.environments import StepResult
from rlcore.rollout.multiturn import EpisodeEngine, GenerateContext, with_env_reward
from rlcore.rollout.rewards import score_samples
from rlcore.rollout.tools import (
    ChatTemplateFormat,
    MalformedCall,
    PlainFormat,
    ToolCall,
    ToolEnvironment,
    parse_tool_calls,
)
from rlcore.samples import Generation, Prompt, SamplingParams, Turn
from rlcore.testing import ScriptedEngine
from rlcore.weights import WeightSink

EOS = 3  # a code point no script writes


class CodepointTokenizer:
    """Ids are code points; ``encode`` prepends 1 (a BOS); ``decode`` drops ids below 32."""

    pad_token_id = 0
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [1, *(ord(c) for c in text)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(t) for t in token_ids if t >= 32 or t == 10)


TOK = CodepointTokenizer()


def text_of(ids: Sequence[int]) -> str:
    return TOK.decode(ids)


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def boom() -> str:
    raise ValueError("no such luck")


def sleepy() -> str:
    time.sleep(5.0)
    return "late"


def tool_env(prompt: Prompt, tokenizer: object) -> ToolEnvironment:
    return ToolEnvironment([add, boom, sleepy], TOK, timeout=0.2)


def stop_script(turns: dict[str, list[str]]) -> ScriptedEngine:
    """An engine answering each prompt's ``n``-th request (counted from the number of
    ``<tool_response>`` blocks in its context) with ``turns[label][n]`` plus the stop token."""

    def script(prompt: Prompt, index: int) -> str:
        del index
        context = text_of(prompt.token_ids)
        n = context.count("<tool_response>")
        return turns[prompt.label][n] + chr(EOS)

    return ScriptedEngine(script)


PARAMS = SamplingParams(max_new_tokens=400, stop_token_ids=(EOS,))


def prompt(label: str, index: int = 0) -> Prompt:
    return Prompt(index, "q", tuple(TOK.encode("q:")), label)


def test_parse_tool_calls() -> None:
    text = (
        "think " + call("add", a=1, b=2) + " and <tool_call>{bad json</tool_call>"
        '<tool_call>["x"]</tool_call><tool_call>{"name": "f", "arguments": 3}</tool_call>'
        '<tool_call>{"name": "g"}</tool_call> then <tool_call>{"name": "h"'
    )
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert isinstance(calls[1], MalformedCall) and "not valid JSON" in calls[1].problem
    assert isinstance(calls[2], MalformedCall) and "name" in calls[2].problem
    assert isinstance(calls[3], MalformedCall) and "arguments" in calls[3].problem
    assert calls[4] == ToolCall("g", {})
    assert isinstance(calls[5], MalformedCall) and "never closed" in calls[5].problem
    assert parse_tool_calls("no calls here") == []


def test_tool_environment_runs_calls_and_reports_every_failure_as_an_observation() -> None:
    env = ToolEnvironment([add, boom, sleepy], TOK, timeout=0.2)
    turn_text = (
        call("add", a=2, b=40)
        + call("boom")
        + call("sleepy")
        + call("nope")
        + call("add", a=1)
        + "<tool_call>{oops</tool_call>"
    )
    start = time.perf_counter()
    result = asyncio.run(env.step(Turn("model", (), turn_text)))
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0  # the hanging tool (5 s) was abandoned after its 0.2 s timeout
    assert not result.done
    bodies = result.observation.split("</tool_response>\n")[:-1]
    assert [b.removeprefix("<tool_response>\n").removesuffix("\n") for b in bodies] == [
        "42",
        "error: ValueError: no such luck",
        "error: sleepy timed out after 0.2 s",
        "error: unknown tool 'nope' (tools: add, boom, sleepy)",
        "error: TypeError: add() missing 1 required positional argument: 'b'",
        "error: malformed tool call: not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))",
    ]
    # The observation's ids are its text's, without the tokenizer's BOS.
    assert list(result.observation_ids) == [ord(c) for c in result.observation]
    assert len(env.calls) == 6
    final = asyncio.run(env.step(Turn("model", (), "the answer is 42")))
    assert final.done and final.observation_ids == ()


def test_episode_is_token_in_token_out_with_a_loss_mask() -> None:
    engine = stop_script({"x": [call("add", a=20, b=22), "It is 42."]})
    wrapped = EpisodeEngine(engine, TOK, max_turns=4, make_environment=tool_env)
    (gen,) = wrapped.generate([prompt("x")], PARAMS)
    assert gen.finish_reason == "stop"
    assert [t.role for t in gen.turns] == ["model", "environment", "model"]
    model1, obs, model2 = gen.turns
    assert text_of(model1.token_ids) == call("add", a=20, b=22)
    assert model1.token_ids[-1] == EOS and model2.token_ids[-1] == EOS
    assert obs.text == "<tool_response>\n42\n</tool_response>\n"
    assert gen.token_ids == model1.token_ids + obs.token_ids + model2.token_ids
    assert gen.loss_mask == (1,) * len(model1.token_ids) + (0,) * len(obs.token_ids) + (1,) * len(
        model2.token_ids
    )
    # Engine log-probs on model tokens (the script's -1.0), 0.0 on the observation.
    assert gen.log_probs == tuple(-1.0 if m else 0.0 for m in gen.loss_mask)
    assert engine.calls[1][0] == 1
    assert "It is 42." in gen.text and gen.model_tokens == len(model1.token_ids) + len(
        model2.token_ids
    )


def test_episodes_run_concurrently_and_their_turns_are_batched() -> None:
    seen: list[list[tuple[int, ...]]] = []
    base = stop_script(
        {
            "a": [call("add", a=1, b=1), "done"],
            "b": [call("add", a=2, b=2), call("add", a=3, b=3), "done"],
            "c": ["done right away"],
        }
    )

    class Recording:
        def __init__(self) -> None:
            self.weight_version = 0

        def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
            seen.append([p.token_ids for p in prompts])
            return base.generate(prompts, params)

        def receive_weights(self, version: int) -> AbstractContextManager[Sequence[WeightSink]]:
            return base.receive_weights(version)

        def close(self) -> None:
            pass

    wrapped = EpisodeEngine(Recording(), TOK, max_turns=5, make_environment=tool_env)
    prompts = [prompt("a", 0), prompt("b", 1), prompt("c", 2), prompt("a", 0)]
    gens = wrapped.generate(prompts, PARAMS)
    # Step 1: all four episodes; step 2: the three that called a tool; step 3: "b" alone.
    assert [len(batch) for batch in seen] == [4, 3, 1]
    assert wrapped.engine_calls == 3
    # Each later request is the exact ids of that episode so far.
    assert (
        seen[1][0] == prompts[0].token_ids + gens[0].turns[0].token_ids + gens[0].turns[1].token_ids
    )
    assert [len(g.turns) for g in gens] == [3, 5, 1, 3]


def test_budget_counts_every_turn_and_truncation_is_marked() -> None:
    engine = stop_script({"x": [call("add", a=1, b=2)] * 10})
    wrapped = EpisodeEngine(engine, TOK, max_turns=10, make_environment=tool_env)
    first_turn = len(call("add", a=1, b=2)) + 1
    budget = first_turn + 10  # the observation (34 tokens) does not fit
    (gen,) = wrapped.generate([prompt("x")], SamplingParams(budget, stop_token_ids=(EOS,)))
    assert len(gen.token_ids) == budget and gen.finish_reason == "length"
    assert gen.loss_mask == (1,) * first_turn + (0,) * 10

    (gen,) = EpisodeEngine(engine, TOK, max_turns=2, make_environment=tool_env).generate(
        [prompt("x")], PARAMS
    )
    # Two model turns and the observation between them; no observation after the last turn.
    assert [t.role for t in gen.turns] == ["model", "environment", "model"]
    assert gen.finish_reason == "length"


def test_a_turn_cut_by_the_budget_ends_the_episode() -> None:
    engine = stop_script({"x": ["a very long answer without a call"]})
    (gen,) = EpisodeEngine(engine, TOK, max_turns=3, make_environment=tool_env).generate(
        [prompt("x")], SamplingParams(5, stop_token_ids=(EOS,))
    )
    assert text_of(gen.token_ids) == "a ver" and gen.finish_reason == "length"
    assert gen.loss_mask == (1,) * 5


class Rewarding:
    """An environment that rewards each step 0.5 and ends after two steps."""

    def __init__(self) -> None:
        self.steps = 0

    async def step(self, turn: Turn) -> StepResult:
        self.steps += 1
        if self.steps == 2:
            return StepResult(reward=0.5, done=True)
        ids = tuple(TOK.encode("<tool_response>ok</tool_response>")[1:])
        return StepResult(ids, "ok", reward=0.5)


def test_environment_rewards_replace_or_add() -> None:
    engine = stop_script({"x": ["one", "two"]})
    wrapped = EpisodeEngine(engine, TOK, max_turns=4, make_environment=lambda p, t: Rewarding())
    (gen,) = wrapped.generate([prompt("x")], PARAMS)
    assert gen.env_reward == 1.0 and gen.finish_reason == "stop"

    def two(p: Prompt, g: Generation) -> float:
        return 2.0

    p = prompt("x")
    assert score_samples([p], [gen], with_env_reward(two, "ignore")) == [2.0]
    assert score_samples([p], [gen], with_env_reward(two, "replace")) == [1.0]
    assert score_samples([p], [gen], with_env_reward(two, "add")) == [3.0]
    plain = Generation((65,), (0.0,), "A")
    assert score_samples([p], [plain], with_env_reward(two, "replace")) == [0.0]


def test_the_rollout_seam_gets_scored_episode_groups() -> None:
    engine = stop_script({"x": [call("add", a=20, b=22), "42"]})
    wrapped = EpisodeEngine(engine, TOK, max_turns=3, make_environment=tool_env)

    def saw_the_tool(p: Prompt, g: Generation) -> float:
        # The reward sees the whole episode: turns, the tool call and its result.
        return float(any(t.role == "environment" and "42" in t.text for t in g.turns))

    (group,) = generate_groups(wrapped, saw_the_tool, [prompt("x")], 2, PARAMS)
    assert [s.reward for s in group] == [1.0, 1.0]
    assert all(s.response.loss_mask for s in group)


def test_a_failing_environment_or_generate_function_is_named() -> None:
    class Broken:
        async def step(self, turn: Turn) -> StepResult:
            raise KeyError("state")

    engine = stop_script({"x": ["hi"]})
    wrapped = EpisodeEngine(engine, TOK, max_turns=2, make_environment=lambda p, t: Broken())
    with pytest.raises(
        RolloutError,
        match=r"environment tests\.rollout\.test_multiturn\..*"
        r"\.Broken\.step raised KeyError: 'state' at turn 0 of prompt 0",
    ):
        wrapped.generate([prompt("x")], PARAMS)

    def no_room(p: Prompt, t: object) -> Broken:
        raise RuntimeError("no sandbox left")

    wrapped = EpisodeEngine(engine, TOK, max_turns=2, make_environment=no_room)
    with pytest.raises(RolloutError) as info:
        wrapped.generate([prompt("x")], PARAMS)
    assert str(info.value).startswith(
        f"environment factory {__name__}.test_a_failing_environment_or_generate_function_is_named"
        ".<locals>.no_room raised RuntimeError: no sandbox left for prompt 0; fix "
        "--environment-path"
    ), str(info.value)

    async def raises(ctx: GenerateContext, p: Prompt) -> Generation:
        raise ValueError("my bug")

    with pytest.raises(
        RolloutError,
        match=r"generate function .*raises raised ValueError: my "
        r"bug for prompt 0; fix --custom-generate-function-path",
    ):
        EpisodeEngine(engine, TOK, max_turns=1, generate_fn=raises).generate([prompt("x")], PARAMS)

    class ReturnsADict:
        async def step(self, turn: Turn) -> StepResult:
            return {"observation": "no", "done": True}  # type: ignore[return-value]  # the misuse

    wrapped = EpisodeEngine(engine, TOK, max_turns=2, make_environment=lambda p, t: ReturnsADict())
    with pytest.raises(RolloutError) as info:
        wrapped.generate([prompt("x")], PARAMS)
    assert (
        f"environment {__name__}.test_a_failing_environment_or_generate_function_is_named.<locals>"
        ".ReturnsADict.step returned dict \"{'observation': 'no', 'done': True}\" at turn 0 of "
        "prompt 0, not a StepResult; return rlcore.rollout.environments.StepResult("
    ) in str(info.value)

    async def too_long(ctx: GenerateContext, p: Prompt) -> Generation:
        return Generation((65,) * 9, (0.0,) * 9, "A" * 9)

    with pytest.raises(RolloutError, match="--rollout-max-response-len is 5"):
        EpisodeEngine(engine, TOK, max_turns=1, generate_fn=too_long).generate(
            [prompt("x")], SamplingParams(5)
        )
    with pytest.raises(RolloutError, match="--environment-path"):
        EpisodeEngine(engine, TOK, max_turns=1).generate([prompt("x")], PARAMS)


def test_custom_generate_function_uses_the_batching_engine() -> None:
    engine = stop_script({"x": ["hello"]})

    async def single_turn(ctx: GenerateContext, p: Prompt) -> Generation:
        first = await ctx.engine.generate(p, ctx.params.max_new_tokens)
        return first

    gens = EpisodeEngine(engine, TOK, max_turns=1, generate_fn=single_turn).generate(
        [prompt("x"), prompt("x")], PARAMS
    )
    assert [text_of(g.token_ids) for g in gens] == ["hello", "hello"]
    assert engine.calls[0][0] == 2  # both samples in one engine call


def test_plain_format_template_and_chat_template_format() -> None:
    fmt = PlainFormat(TOK, template="[{name}={content}]", suffix="\n")
    from rlcore.rollout.tools import ToolResult

    ids, text = fmt([ToolResult("add", "3"), ToolResult("x", "4")], Turn("model", (), ""))
    assert text == "[add=3][x=4]\n" and list(ids) == [ord(c) for c in text]

    class Chat(CodepointTokenizer):
        """A Qwen-like template: im_end is the model's stop token (id 3)."""

        def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
            out = ""
            for m in messages:
                role = "user" if m["role"] == "tool" else m["role"]
                body = (
                    f"<tool_response>\n{m['content']}\n</tool_response>"
                    if m["role"] == "tool"
                    else m["content"]
                )
                out += f"<s>{role}\n{body}\x03\n"
            return out + "<s>assistant\n"

        def encode_rendered(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    chat = ChatTemplateFormat(Chat())
    ids, text = chat([ToolResult("add", "3")], Turn("model", (65, EOS), "A"))
    assert text == "\x03\n<s>user\n<tool_response>\n3\n</tool_response>\x03\n<s>assistant\n"
    # The model already emitted the end-of-turn token: it is not inserted twice.
    assert list(ids) == [ord(c) for c in text[1:]]


def test_hung_tool_threads_do_not_block_other_episodes() -> None:
    started = threading.Event()

    def hang() -> str:
        started.set()
        time.sleep(1.0)
        return "x"

    env = ToolEnvironment([hang], TOK, timeout=0.1)
    result = asyncio.run(env.step(Turn("model", (), call("hang"))))
    assert started.is_set() and "timed out after 0.1 s" in result.observation


QWEN_STYLE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5's layout of tool results (its template's tool branch, trimmed to what is used here)."""


def test_a_real_chat_template_formats_tool_results(tmp_path: Path) -> None:
    """Qwen2.5's tool-turn layout through a Hugging Face tokenizer's own chat template."""
    from transformers import AutoTokenizer

    from rlcore.data.hf_tokenizer import HFTokenizer
    from rlcore.rollout.tools import ToolResult, default_observation_format
    from rlcore.testing.tiny import build_char_tokenizer

    hf = build_char_tokenizer(tmp_path, "0123456789abcdefghijklmnopqrstuvwxyz_<>/|\n ")
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.eos_token = "<|im_end|>"
    hf.chat_template = QWEN_STYLE_TEMPLATE
    hf.save_pretrained(str(tmp_path))
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(tmp_path)))
    fmt = default_observation_format(tok)
    assert isinstance(fmt, ChatTemplateFormat)
    model_turn = Turn("model", (*tok.encode_rendered("abc"), tok.eos_token_id), "abc")
    ids, text = fmt([ToolResult("add", "42"), ToolResult("add", "7")], model_turn)
    assert text == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response>"
        "\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # Appended to the model's turn (which ended with <|im_end|>), the ids are exactly the
    # template's rendering of the whole conversation from there on.
    assert list(ids) == tok.encode_rendered(text)[1:]
    assert tok.decode(model_turn.token_ids + ids).startswith("abc\n")


def test_config_checks_the_multiturn_flags() -> None:
    from rlcore.config import MultiTurnConfig, RolloutConfig, RunConfig
    from rlcore.errors import ConfigError

    rollout = RolloutConfig(num_rollout=1)
    with pytest.raises(ConfigError, match="--max-turns"):
        RunConfig(rollout, multiturn=MultiTurnConfig(environment_path="a:b", max_turns=0))
    with pytest.raises(ConfigError, match="--env-reward"):
        RunConfig(rollout, multiturn=MultiTurnConfig(env_reward="add"))
    custom = MultiTurnConfig(custom_generate_function_path="a:b", env_reward="replace")
    assert RunConfig(rollout, multiturn=custom).multiturn.enabled
    assert not RunConfig(rollout).multiturn.enabled


def test_bad_function_paths_name_their_flag() -> None:
    from rlcore.errors import ConfigError
    from rlcore.rollout.multiturn import load_custom_generate_function, load_environment_factory

    with pytest.raises(ConfigError, match="--environment-path"):
        load_environment_factory("rlcore.rollout.tools:nothing_here")
    with pytest.raises(ConfigError, match="--custom-generate-function-path"):
        load_custom_generate_function("no_such_module_xyz:generate")
    assert load_environment_factory("rlcore.launch.tool_demo:calculator") is not None


def test_an_engine_failure_reaches_every_episode() -> None:
    def script(p: Prompt, i: int) -> str:
        raise RolloutError("server gone")

    wrapped = EpisodeEngine(ScriptedEngine(script), TOK, max_turns=2, make_environment=tool_env)
    with pytest.raises(RolloutError, match="server gone"):
        wrapped.generate([prompt("x"), prompt("y", 1)], PARAMS)


def test_rollout_metrics_count_turns_and_model_tokens() -> None:
    from rlcore.loop.stages import rollout_metrics
    from rlcore.samples import Sample

    engine = stop_script({"x": [call("add", a=1, b=2), "3"]})
    (gen,) = EpisodeEngine(engine, TOK, max_turns=3, make_environment=tool_env).generate(
        [prompt("x")], PARAMS
    )
    plain = Generation((65, 66), (0.0, 0.0), "AB", "stop")
    metrics = rollout_metrics(
        [Sample(prompt("x"), gen, 1.0, 0), Sample(prompt("x"), plain, 0.0, 0)], 0
    )
    assert metrics["rollout/turns"] == 1.5  # 2 model turns, and 1 (a single-turn sample)
    total = len(gen.token_ids) + 2
    assert metrics["rollout/model_token_frac"] == (gen.model_tokens + 2) / total
