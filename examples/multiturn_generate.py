"""A custom generate function (``--custom-generate-function-path``, slime's flag): one sample,
generated turn by turn, with its own tool loop instead of an Environment.

Run it on the tool demo's data (``python -m rlcore.launch.tool_demo`` prepares it)::

    python -m rlcore_megatron.run ... --custom-generate-function-path \
        examples.multiturn_generate:generate --max-turns 3

What a generate function must do: continue ``prompt.token_ids`` turn by turn through
``ctx.engine`` (its requests are batched with the other samples' turns), append whatever it
inserts as *token ids* with loss mask 0 and log-prob 0.0, stay within
``ctx.params.max_new_tokens`` response tokens in total, and return one
:class:`~rlcore.samples.Generation`.

Coming from slime: slime's ``async def generate(args, sample, sampling_params) -> Sample`` posts
to the SGLang router itself and fills ``sample.tokens``, ``sample.response_length``,
``sample.loss_mask`` and ``sample.rollout_log_probs``. Here the signature is
``async def generate(ctx, prompt) -> Generation``: ``ctx.engine.generate(prompt_with_context_ids,
max_new_tokens)`` replaces the HTTP post (and works with the embedded engine too), ``ctx.params``
are the sampling params, ``ctx.max_turns`` is ``--max-turns``, and the result's ``token_ids`` /
``loss_mask`` / ``log_probs`` are slime's response tokens / loss mask / rollout log-probs (for
the response only: the prompt's ids stay in ``prompt.token_ids``).
"""

from __future__ import annotations

import attrs

from rlcore.rollout.multiturn import GenerateContext
from rlcore.rollout.tools import ToolCall, parse_tool_calls
from rlcore.samples import Generation, Prompt, Turn


def _calculate(call: ToolCall) -> str:
    args = call.arguments
    try:
        return str(int(str(args["a"])) + int(str(args["b"])))
    except (KeyError, ValueError) as exc:
        return f"error: {exc}"


async def generate(ctx: GenerateContext, prompt: Prompt) -> Generation:
    """Model turn -> (if it calls ``add``) the sum as an observation -> model turn, and so on."""
    budget = ctx.params.max_new_tokens
    ids: list[int] = []
    log_probs: list[float] = []
    mask: list[int] = []
    turns: list[Turn] = []
    finish = "length"
    for _ in range(ctx.max_turns):
        context = attrs.evolve(prompt, token_ids=prompt.token_ids + tuple(ids))
        turn = await ctx.engine.generate(context, budget - len(ids))
        ids += turn.token_ids
        log_probs += turn.log_probs
        mask += [1] * len(turn.token_ids)
        turns.append(Turn("model", turn.token_ids, turn.text))
        if turn.finish_reason != "stop":
            break
        calls = [c for c in parse_tool_calls(turn.text) if isinstance(c, ToolCall)]
        if not calls:
            finish = "stop"  # a final answer
            break
        text = "".join(f"<tool_response>{_calculate(c)}</tool_response>" for c in calls)
        encoded = ctx.tokenizer.encode(text)
        bos = len(ctx.tokenizer.encode(""))  # what encode() puts in front (<bos>)
        observation = tuple(encoded[bos:])[: budget - len(ids)]
        ids += observation
        log_probs += [0.0] * len(observation)
        mask += [0] * len(observation)
        turns.append(Turn("environment", observation, text))
        if len(ids) >= budget:
            break
    return Generation(
        tuple(ids),
        tuple(log_probs),
        ctx.tokenizer.decode(ids),
        "stop" if finish == "stop" else "length",
        turn.weight_version,
        loss_mask=tuple(mask),
        turns=tuple(turns),
    )
