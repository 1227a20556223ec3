"""A tool-calling environment: Python functions as tools, called from the model's turns.

Conversation format: the Hermes / Qwen convention, the one Qwen2.5/Qwen3 chat templates,
vLLM's and SGLang's ``hermes``/``qwen25`` tool parsers and verl's and slime's agent examples use.
A model turn calls tools with one or more blocks::

    <tool_call>
    {"name": "add", "arguments": {"a": 12345678, "b": 87654321}}
    </tool_call>

A turn without a ``<tool_call>`` is the model's final answer and ends the episode. Each call
runs with a timeout (in a worker thread, so the event loop and the other episodes go on); its
result, or what went wrong (unknown tool, malformed JSON, bad arguments, an exception, a
timeout), becomes the observation and the episode continues, so the model can learn from it.

Results are formatted as the tokenizer's chat template renders ``{"role": "tool"}`` messages
(:class:`ChatTemplateFormat`: e.g. Qwen's ``<|im_start|>user\n<tool_response>...`` turn,
ending with the assistant prompt of the model's next turn). A tokenizer without a chat template
gets the fallback :class:`PlainFormat`: each result as ``<tool_response>\n{content}\n
</tool_response>\n`` (the body Qwen's template writes), configurable. Either way the observation
is produced as token ids and appended to the ids the model generated: nothing is re-encoded.

A tool that hangs cannot be killed (Python cannot stop a thread): after its timeout the episode
moves on and the thread is left to finish in the background; use a subprocess inside the tool
for work that must be killable.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol, final

import attrs

from rlcore.errors import DataError
from rlcore.protocols.tokenizer import ChatTokenizer, Tokenizer
from rlcore.rollout.environments import StepResult, observation_ids
from rlcore.samples import Turn

__all__ = [
    "ChatTemplateFormat",
    "MalformedCall",
    "ObservationFormat",
    "PlainFormat",
    "Tool",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "default_observation_format",
    "parse_tool_calls",
]

_CALL: Final = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN: Final = "<tool_call>"
_SENTINEL: Final = "\u2063rlcore-model-turn\u2063"


@attrs.frozen
class Tool:
    """A Python function the model may call by ``name`` with keyword ``arguments``. Its return
    value becomes the observation (``str()`` of it, or JSON for dicts and lists)."""

    name: str
    fn: Callable[..., object]
    description: str = ""

    @classmethod
    def of(cls, fn: Callable[..., object]) -> Tool:
        """A tool named after the function, described by its docstring's first line."""
        doc = (inspect.getdoc(fn) or "").strip().splitlines()
        return cls(fn.__name__, fn, doc[0] if doc else "")


@attrs.frozen
class ToolCall:
    """A parsed call: the tool's name and its arguments."""

    name: str
    arguments: Mapping[str, object] = attrs.field(factory=dict)


@attrs.frozen
class MalformedCall:
    """A ``<tool_call>`` block that is not a call: the raw text and what is wrong with it."""

    raw: str
    problem: str


@attrs.frozen
class ToolResult:
    """One call's outcome: ``content`` is the tool's output, or the error message when ``ok`` is
    False."""

    name: str
    content: str
    ok: bool = True


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """The calls in a model turn, in order (module docstring's format). A block whose body is not
    a JSON object with a string ``name`` and an object ``arguments`` (absent: ``{}``), and an
    unclosed ``<tool_call>``, are :class:`MalformedCall` entries."""
    calls: list[ToolCall | MalformedCall] = []
    end = 0
    for match in _CALL.finditer(text):
        end = match.end()
        body = match.group(1).strip()
        try:
            data = json.loads(body)
        except ValueError as exc:
            calls.append(MalformedCall(body, f"not valid JSON ({exc})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(MalformedCall(body, 'expected {"name": ..., "arguments": {...}}'))
            continue
        arguments = data.get("arguments", {})
        if not isinstance(arguments, dict):
            calls.append(MalformedCall(body, '"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(data["name"], arguments))
    if _OPEN in text[end:]:
        rest = text[end:]
        calls.append(MalformedCall(rest[rest.index(_OPEN) :], "<tool_call> is never closed"))
    return calls


class ObservationFormat(Protocol):
    """Turns tool results into the observation appended after the model's turn: its token ids
    (ready to append: in the model's format, ending where the model's next turn begins) and its
    text."""

    def __call__(
        self, results: Sequence[ToolResult], model_turn: Turn, /
    ) -> tuple[tuple[int, ...], str]: ...


@final
@attrs.frozen
class PlainFormat:
    """The fallback format for tokenizers without a chat template: each result as ``template``
    (``{content}`` and ``{name}`` are filled in), joined, then ``suffix``."""

    tokenizer: Tokenizer
    template: str = "<tool_response>\n{content}\n</tool_response>\n"
    suffix: str = ""

    def __call__(
        self, results: Sequence[ToolResult], model_turn: Turn
    ) -> tuple[tuple[int, ...], str]:
        text = "".join(self.template.format(content=r.content, name=r.name) for r in results)
        text += self.suffix
        return tuple(observation_ids(self.tokenizer, text)), text


@final
@attrs.frozen
class ChatTemplateFormat:
    """Results as the tokenizer's chat template renders ``tool`` messages after an assistant
    turn, ending with the template's generation prompt (the opening of the model's next turn).

    The template is rendered for ``[user, assistant(<sentinel>), tool...]``; the observation is
    the text after the sentinel (the end of the assistant turn, the tool turn(s), the next
    assistant prompt). Its ids drop a leading token equal to the model turn's last token: the
    model already emitted the template's end-of-turn token (``<|im_end|>``) as its stop token.
    """

    tokenizer: ChatTokenizer

    def __call__(
        self, results: Sequence[ToolResult], model_turn: Turn
    ) -> tuple[tuple[int, ...], str]:
        messages = [
            {"role": "user", "content": "-"},
            {"role": "assistant", "content": _SENTINEL},
            *({"role": "tool", "content": r.content} for r in results),
        ]
        rendered = self.tokenizer.render_chat(messages)
        if _SENTINEL not in rendered:
            raise DataError(
                "ChatTemplateFormat: the chat template dropped the assistant turn's content; use "
                "PlainFormat (rlcore.rollout.tools) for this tokenizer"
            )
        text = rendered.split(_SENTINEL, 1)[1]
        ids = self.tokenizer.encode_rendered(text)
        if ids and model_turn.token_ids and ids[0] == model_turn.token_ids[-1]:
            ids = ids[1:]
        return tuple(ids), text


def default_observation_format(tokenizer: Tokenizer) -> ObservationFormat:
    """:class:`ChatTemplateFormat` when ``tokenizer`` has a chat template that renders tool
    messages, else :class:`PlainFormat`."""
    if isinstance(tokenizer, ChatTokenizer):
        fmt = ChatTemplateFormat(tokenizer)
        probe = Turn("model", (), "")
        try:
            fmt([ToolResult("probe", "x")], probe)
        except Exception:  # no template, or one that cannot render tool turns: the fallback
            return PlainFormat(tokenizer)
        return fmt
    return PlainFormat(tokenizer)


@final
class ToolEnvironment:
    """An :class:`~rlcore.rollout.environments.Environment` whose steps run the tools the model
    calls.

    ``tools``: the functions (or :class:`Tool` entries) the model may call. ``timeout``: seconds
    each call may take. ``format``: how results become the observation (default:
    :func:`default_observation_format` of ``tokenizer``). ``max_calls_per_turn``: more calls in
    one turn are answered with an error instead of being run.
    """

    def __init__(
        self,
        tools: Sequence[Tool | Callable[..., object]],
        tokenizer: Tokenizer,
        *,
        timeout: float = 5.0,
        format: ObservationFormat | None = None,
        max_calls_per_turn: int = 8,
    ) -> None:
        entries = [t if isinstance(t, Tool) else Tool.of(t) for t in tools]
        self.tools: dict[str, Tool] = {t.name: t for t in entries}
        if len(self.tools) != len(entries):
            raise ValueError("ToolEnvironment: two tools share a name")
        if timeout <= 0:
            raise ValueError(f"ToolEnvironment: timeout must be > 0 seconds, got {timeout}")
        self.timeout = timeout
        self.format = format if format is not None else default_observation_format(tokenizer)
        self.max_calls_per_turn = max_calls_per_turn
        self.calls: list[tuple[ToolCall | MalformedCall, ToolResult]] = []
        """Every call of this episode with its result, in order (for rewards and logs)."""

    async def step(self, turn: Turn, /) -> StepResult:
        calls = parse_tool_calls(turn.text)
        if not calls:
            return StepResult(done=True)
        results = await asyncio.gather(
            *(
                self._run(call)
                if i < self.max_calls_per_turn
                else _error(call, f"more than {self.max_calls_per_turn} calls in one turn")
                for i, call in enumerate(calls)
            )
        )
        self.calls.extend(zip(calls, results, strict=True))
        ids, text = self.format(results, turn)
        return StepResult(observation_ids=ids, observation=text)

    async def _run(self, call: ToolCall | MalformedCall) -> ToolResult:
        if isinstance(call, MalformedCall):
            return ToolResult("", f"error: malformed tool call: {call.problem}", ok=False)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(
                call.name, f"error: unknown tool {call.name!r} (tools: {known})", ok=False
            )
        try:
            value = await asyncio.wait_for(_in_thread(tool, call.arguments), self.timeout)
        except TimeoutError:
            return ToolResult(
                call.name, f"error: {call.name} timed out after {self.timeout:g} s", ok=False
            )
        except Exception as exc:  # the tool's failure is the model's observation
            return ToolResult(call.name, f"error: {type(exc).__name__}: {exc}", ok=False)
        return ToolResult(call.name, _as_text(value))


def _in_thread(tool: Tool, arguments: Mapping[str, object]) -> asyncio.Future[object]:
    """``tool.fn(**arguments)`` on a daemon thread of its own, as a future of the running loop.
    Not the loop's default executor: ``asyncio.run`` joins that one on exit, so a hung tool would
    hold up the rollout; and a daemon thread does not hold up the interpreter's exit either."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[object] = loop.create_future()

    def settle(value: object, error: BaseException | None) -> None:
        if future.done():  # timed out and cancelled meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        try:
            value, error = tool.fn(**arguments), None
        except BaseException as exc:  # handed to the awaiting episode
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is closed: nobody waits for this result any more
            pass

    threading.Thread(target=target, name=f"rlcore-tool-{tool.name}", daemon=True).start()
    return future


async def _error(call: ToolCall | MalformedCall, problem: str) -> ToolResult:
    return ToolResult(call.name if isinstance(call, ToolCall) else "", f"error: {problem}", False)


def _as_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)
