"""The multi-turn demo: a tiny model learns, from reward alone, to add with a calculator tool.

Adding 3-digit numbers digit by digit with carries is beyond a freshly trained 2-layer, 64-wide
model; copying the operands into a tool call and the tool's result back is not. An episode::

    prompt       482+518=
    model        <tool_call>{"name":"add","arguments":{"a":482,"b":518}}</tool_call><eos>
    environment  <tool_response>1000</tool_response>            (loss mask 0)
    model        1000<eos>

The warm start's demonstrations are mixed, as data gathered from several sources is: half of
them call the calculator, half write the sum straight away (``TOOL_FRACTION``). The model imitates
both, but only the calls work for it: its own sums are wrong. After the supervised warm start its
greedy choice is mostly to answer directly (held-out accuracy 0.35-0.51 with the calculator
available, over 3 seeds), while at temperature 1 it calls the tool about half the time and then
usually gets the sum right. The GRPO phase is what makes it work: the reward pays for the calls,
and held-out accuracy goes to 0.92-1.00 (README: the curves).

Calls use the Hermes/Qwen ``<tool_call>{json}</tool_call>`` format (parsed by
:func:`rlcore.rollout.tools.parse_tool_calls`); the tokenizer has no chat template, so results use
the documented fallback, :class:`rlcore.rollout.tools.PlainFormat` with the template
``<tool_response>{content}</tool_response>``. The tokenizer is character-level plus a few
multi-character tokens for the fixed parts of the call, so an episode is about 23 tokens.

Two CLI runs (:func:`tool_demo_flags`): the warm start alone (``--sft-warmup-rollouts`` equal to
``--num-rollout``), then GRPO from its checkpoint with ``--finetune`` (its weights, a fresh
optimizer and learning-rate schedule at the lower RL rate). The held-out set is scored with the
tool (``heldout``) and, at the end, with a calculator that refuses every call (``no_calculator``:
the model must add by itself).

Everything is built locally (:mod:`rlcore.new_model`): tokenizer, tiny Llama, data files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Final

from rlcore.protocols.tokenizer import Tokenizer
from rlcore.rollout.tools import PlainFormat, ToolEnvironment
from rlcore.samples import Generation, Prompt

__all__ = [
    "DIGITS",
    "add",
    "calculator",
    "final_answer_reward",
    "no_calculator",
    "prepare_tool_demo",
    "tool_demo_eval_flags",
    "tool_demo_flags",
]

DIGITS: Final = 3
"""Digits per operand."""
TOOL_FRACTION: Final = 0.5
"""The share of the warm start's demonstrations that call the calculator (the rest write the
sum directly)."""
CALL_OPEN: Final = '<tool_call>{"name":"add","arguments":{"a":'
CALL_MID: Final = ',"b":'
CALL_CLOSE: Final = "}}</tool_call>"
RESPONSE_OPEN: Final = "<tool_response>"
RESPONSE_CLOSE: Final = "</tool_response>"
PIECES: Final = ("<tool_call>", '{"name":"add","arguments":{"a":', CALL_MID, "}}", "</tool_call>")
PIECES_ALL: Final = (*PIECES, RESPONSE_OPEN, RESPONSE_CLOSE)
ALPHABET: Final = "".join(chr(c) for c in range(32, 127)) + "\n"
"""Single characters: printable ASCII and newline, so that every observation (error messages
quote the model's malformed JSON) encodes: a WordLevel model without ``<unk>`` refuses others."""
OBSERVATION_FORMAT: Final = RESPONSE_OPEN + "{content}" + RESPONSE_CLOSE


def add(a: int, b: int) -> int:
    """Add two integers."""
    return int(a) + int(b)


def _trace(a: int, b: int) -> str:
    """The label: the whole tool-use trace after the prompt (the warm start's target)."""
    call = f"{CALL_OPEN}{a}{CALL_MID}{b}{CALL_CLOSE}"
    return f"{call}<eos>{RESPONSE_OPEN}{a + b}{RESPONSE_CLOSE}{a + b}"


def calculator(prompt: Prompt, tokenizer: Tokenizer) -> ToolEnvironment:
    """``--environment-path``: one ``add`` tool, results in the demo's fallback format."""
    del prompt
    return ToolEnvironment(
        [add], tokenizer, timeout=2.0, format=PlainFormat(tokenizer, template=OBSERVATION_FORMAT)
    )


def _refuse(a: int, b: int) -> int:
    raise RuntimeError("no tool")


def no_calculator(prompt: Prompt, tokenizer: Tokenizer) -> ToolEnvironment:
    """The same environment whose ``add`` always fails: the model must add by itself."""
    del prompt
    from rlcore.rollout.tools import Tool

    return ToolEnvironment(
        [Tool("add", _refuse)],
        tokenizer,
        timeout=2.0,
        format=PlainFormat(tokenizer, template=OBSERVATION_FORMAT),
    )


def final_answer_reward(prompt: Prompt, generation: Generation) -> float:
    """1.0 when the model's last turn is exactly the sum (the label trace's last part).

    Reads the episode's turns: the answer must come from a model turn (an observation that
    happens to hold the sum does not count)."""
    answer = prompt.label.rsplit(RESPONSE_CLOSE, 1)[-1]
    model_turns = [t for t in generation.turns if t.role == "model"]
    final = model_turns[-1].text if model_turns else generation.text
    return float(final.strip() == answer)


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare_tool_demo(
    folder: Path,
    seed: int = 0,
    *,
    train_size: int = 20000,
    heldout: int = 100,
    tool_fraction: float = TOOL_FRACTION,
) -> None:
    """Tokenizer, tiny Llama and data under ``folder`` (idempotent: kept when present).

    A training row's label is the whole tool-use trace (a share ``tool_fraction`` of them) or
    the sum alone; a held-out row's label is always the trace (the reward reads its final
    answer)."""
    from rlcore.new_model import Sizes, build_model, build_tokenizer

    model = folder / "model"
    if not (model / "config.json").is_file():
        tokenizer = build_tokenizer(model, alphabet=ALPHABET, words=PIECES_ALL)
        build_model(
            model,
            vocab_size=len(tokenizer),
            family="llama",
            sizes=Sizes(max_position_embeddings=64),  # 2 layers of width 64: the defaults
            seed=seed,
        )
    if not (folder / "eval.jsonl").is_file():
        rng = random.Random(seed)
        low, high = 10 ** (DIGITS - 1), 10**DIGITS - 1
        pairs = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(heldout)]
        _write_jsonl(folder / "eval.jsonl", [_row(a, b, tool=True) for a, b in pairs])
        rows = []
        for _ in range(train_size):
            a, b = rng.randint(low, high), rng.randint(low, high)
            rows.append(_row(a, b, tool=rng.random() < tool_fraction))
        _write_jsonl(folder / "train.jsonl", rows)


def _row(a: int, b: int, *, tool: bool) -> dict[str, str]:
    return {"prompt": f"{a}+{b}=", "label": _trace(a, b) if tool else str(a + b)}


WARM_START_ROLLOUTS: Final = 600
"""Warm-start rollouts (64 demonstrations each)."""
GRPO_ROLLOUTS: Final = 60
RL_LR: Final = "3e-4"
"""The GRPO phase's learning rate. The warm start's 1e-3 destroys the policy under GRPO (entropy
rises and held-out accuracy falls to 0 within 10 rollouts, see the README); 1e-4 learns, slowly."""


def tool_demo_flags(
    folder: Path,
    phase: str = "grpo",
    *,
    warm: int = WARM_START_ROLLOUTS,
    grpo: int = GRPO_ROLLOUTS,
    seed: int = 0,
    out: Path | None = None,
) -> list[str]:
    """The flags of one phase of the demo (``--help`` says what each does); checkpoints and run
    outputs go under ``out`` (default: ``folder``, which holds the model and data).

    ``warm``: the supervised warm start alone (``--sft-warmup-rollouts`` = ``--num-rollout``),
    64 demonstrations per rollout, learning rate 1e-3, saved to ``ckpt_warm`` at the end.
    ``grpo``: ``--load ckpt_warm --finetune`` (the weights; a fresh optimizer and schedule)
    and GRPO on calculator episodes, 16 prompts x 8 episodes per rollout, learning rate
    :data:`RL_LR`, saved to ``ckpt``."""
    here = "rlcore.launch.tool_demo"
    out = folder if out is None else out
    common = [
        *("--hf-checkpoint", str(folder / "model"), "--prompt-data", str(folder / "train.jsonl")),
        *("--input-key", "prompt", "--label-key", "label"),
        *("--eval-prompt-data", "heldout", str(folder / "eval.jsonl")),
        *("--custom-rm-path", f"{here}:final_answer_reward"),
        *("--environment-path", f"{here}:calculator", "--max-turns", "3"),
        *("--rollout-max-response-len", "32", "--rollout-temperature", "1.0"),
        *("--clip-grad", "1.0", "--eval-temperature", "0", "--seed", str(seed)),
    ]
    if phase == "warm":
        return [
            *common,
            *("--num-rollout", str(warm), "--sft-warmup-rollouts", str(warm)),
            *("--rollout-batch-size", "64", "--n-samples-per-prompt", "1"),
            *("--global-batch-size", "64", "--micro-batch-size", "64", "--lr", "1e-3"),
            *("--eval-interval", str(max(warm // 4, 1)), "--save", str(out / "ckpt_warm")),
            *("--save-interval", str(warm), "--overwrite-save"),  # a rerun replaces them
            *("--output-dir", str(out / "run_warm")),
        ]
    return [
        *common,
        *("--load", str(out / "ckpt_warm"), "--finetune", "--num-rollout", str(grpo)),
        *("--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--lr", RL_LR),
        *("--global-batch-size", "128", "--micro-batch-size", "128"),
        *("--eval-interval", "10", "--save", str(out / "ckpt"), "--save-interval", str(grpo)),
        *("--output-dir", str(out / "run_grpo"), "--overwrite-save"),
    ]


def tool_demo_eval_flags(
    folder: Path, environment: str = "calculator", out: Path | None = None
) -> list[str]:
    """Eval-only flags for the GRPO phase's checkpoint (under ``out``, default ``folder``), with
    the ``calculator`` environment or ``no_calculator`` (every call refused)."""
    here = "rlcore.launch.tool_demo"
    out = folder if out is None else out
    return [
        *("--num-rollout", "0", "--load", str(out / "ckpt")),
        *(
            "--hf-checkpoint",
            str(folder / "model"),
            "--input-key",
            "prompt",
            "--label-key",
            "label",
        ),
        *("--eval-prompt-data", "heldout", str(folder / "eval.jsonl")),
        *("--custom-rm-path", f"{here}:final_answer_reward"),
        *("--environment-path", f"{here}:{environment}", "--max-turns", "3"),
        *("--rollout-max-response-len", "32", "--eval-temperature", "0"),
        *("--output-dir", str(out / f"eval_{environment}")),
    ]


def main() -> int:
    """``python -m rlcore.launch.tool_demo [FOLDER] [--train-backend NAME ...]``: prepare, warm
    start, GRPO, then score the held-out set with and without the calculator; flags after the
    folder (the backend, say) go to every run."""
    from rlcore.launch.cli import main as run_main

    args = sys.argv[1:]
    named = bool(args) and not args[0].startswith("--")
    folder = Path(args[0]) if named else Path("runs/tool_demo")
    extra = args[1:] if named else args
    prepare_tool_demo(folder)
    for argv in (
        tool_demo_flags(folder, "warm"),
        tool_demo_flags(folder, "grpo"),
        tool_demo_eval_flags(folder, "calculator"),
        tool_demo_eval_flags(folder, "no_calculator"),
    ):
        code = run_main([*argv, *extra])
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
