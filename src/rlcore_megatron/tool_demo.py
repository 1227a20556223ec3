"""The multi-turn demo: a tiny model learns to add long numbers by calling a calculator tool.

X
8-digit numbers digit by digit with carries is beyond a freshly trained 2-layer, 64-wide model;
copying the operands into a tool call and copying the tool's result back is not. An episode::

    prompt       48213907+51822374=
    model        <tool_call>{"name":"add","arguments":{"a":48213907,"b":51822374}}</tool_call><eos>
    environment  <tool_response>100036281</tool_response>            (loss mask 0)
    model        100036281<eos>

Calls use the Hermes/Qwen ``<tool_call>{json}</tool_call>`` format (parsed by
:func:`rlcore.rollout.tools.parse_tool_calls`); the tokenizer has no chat template, so results use
the documented fallback, :class:`rlcore.rollout.tools.PlainFormat` with the template
``<tool_response>{content}</tool_response>``. The tokenizer is character-level plus a few
multi-character tokens for the fixed parts of the call, so an episode is about 37 tokens.

The run is a supervised warm start on tool-use traces (``--sft-warmup-rollouts``: the label is
the whole trace, the reward reads its final answer), then GRPO on episodes with the calculator.
The held-out set is scored with the tool (``heldout``) and with a calculator that refuses every
call (``heldout_no_tool``: the model must add by itself).

Everything is built locally: tokenizer, tiny Llama, data files.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Final

from rlcore.data import Tokenizer
from rlcore.rollout.tools import PlainFormat, ToolEnvironment
from rlcore.samples import Generation, Prompt

__all__ = [
    "DIGITS",
    "add",
    "build_tool_tokenizer",
    "calculator",
    "final_answer_reward",
    "no_calculator",
    "prepare_tool_demo",
    "tool_demo_eval_flags",
    "tool_demo_flags",
]

DIGITS: Final = 6
"""Digits per operand."""
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
SPECIAL: Final = ("<pad>", "<bos>", "<eos>")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return int(a) + int(b)


def build_tool_tokenizer(folder: Path) -> object:
    """A character tokenizer plus one token per fixed piece of a call (``<tool_call>``, the JSON
    up to the first argument, ...), saved with ``save_pretrained`` into ``folder``; ids: pad 0,
    bos 1, eos 2. Returns the ``PreTrainedTokenizerFast``."""
    import re

    from tokenizers import Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for piece in (*PIECES_ALL, *ALPHABET):
        vocab.setdefault(piece, len(vocab))
    raw = RawTokenizer(models.WordLevel(vocab, unk_token=None))
    pattern = "|".join(re.escape(p) for p in sorted(PIECES_ALL, key=len, reverse=True)) + "|."
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    raw.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 1)]
    )
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(list(SPECIAL))
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers: unannotated
        tokenizer_object=raw,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=128,
    )
    folder.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(folder))
    return wrapped


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
    folder: Path, seed: int = 0, *, train_size: int = 20000, heldout: int = 100
) -> None:
    """Tokenizer, tiny Llama and data under ``folder`` (idempotent: kept when present)."""
    from rlcore.testing.tiny import build_tiny_llama

    model = folder / "model"
    if not (model / "config.json").is_file():
        tokenizer = build_tool_tokenizer(model)
        build_tiny_llama(
            model,
            vocab_size=len(tokenizer),  # type: ignore[arg-type]  # a PreTrainedTokenizerFast
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            max_position_embeddings=96,
            seed=seed,
        )
    if not (folder / "eval.jsonl").is_file():
        rng = random.Random(seed)
        low, high = 10 ** (DIGITS - 1), 10**DIGITS - 1
        rows = []
        for _ in range(train_size + heldout):
            a, b = rng.randint(low, high), rng.randint(low, high)
            rows.append({"prompt": f"{a}+{b}=", "label": _trace(a, b)})
        _write_jsonl(folder / "train.jsonl", rows[heldout:])
        _write_jsonl(folder / "eval.jsonl", rows[:heldout])


WARM_START_ROLLOUTS: Final = 300
"""Warm-start rollouts (128 distinct traces each)."""
GRPO_ROLLOUTS: Final = 60


def tool_demo_flags(
    folder: Path, phase: str = "grpo", *, warm: int = WARM_START_ROLLOUTS, grpo: int = GRPO_ROLLOUTS
) -> list[str]:
    """The flags of one phase of the demo (``--help`` says what each does).

    ``warm``: the supervised warm start on tool-use traces, 128 distinct prompts per rollout
    (twice each: GRPO's groups need two samples, and the warm start trains on each prompt's
    trace once per sample), then one GRPO rollout (``--sft-warmup-rollouts`` must leave one).
    ``grpo``: resumes that checkpoint and runs GRPO on calculator episodes, 16 prompts x 8
    episodes per rollout."""
    here = "rlcore_megatron.tool_demo"
    common = [
        *("--hf-checkpoint", str(folder / "model"), "--prompt-data", str(folder / "train.jsonl")),
        *("--input-key", "prompt", "--label-key", "label"),
        *("--eval-prompt-data", "heldout", str(folder / "eval.jsonl")),
        *("--custom-rm-path", f"{here}:final_answer_reward"),
        *("--environment-path", f"{here}:calculator", "--max-turns", "3"),
        *("--rollout-max-response-len", "40", "--rollout-temperature", "1.0"),
        *("--lr", "1e-3", "--clip-grad", "1.0", "--eval-temperature", "0"),
        *("--save", str(folder / "ckpt"), "--seed", "0"),
        *("--sft-warmup-rollouts", str(warm)),
    ]
    if phase == "warm":
        return [
            *common,
            *("--num-rollout", str(warm + 1), "--rollout-batch-size", "128"),
            *("--n-samples-per-prompt", "2", "--global-batch-size", "256"),
            *("--micro-batch-size", "128", "--eval-interval", "50"),
            *("--save-interval", str(warm + 1), "--output-dir", str(folder / "run_warm")),
        ]
    return [
        *common,
        *("--load", str(folder / "ckpt"), "--num-rollout", str(warm + 1 + grpo)),
        *("--rollout-batch-size", "16", "--n-samples-per-prompt", "8"),
        *("--global-batch-size", "128", "--micro-batch-size", "128"),
        *("--eval-interval", "10", "--save-interval", str(grpo)),
        *("--output-dir", str(folder / "run_grpo")),
    ]


def tool_demo_eval_flags(folder: Path, environment: str = "calculator") -> list[str]:
    """Eval-only flags for the demo's saved checkpoint, with the ``calculator`` environment or
    ``no_calculator`` (every call refused)."""
    here = "rlcore_megatron.tool_demo"
    return [
        *("--num-rollout", "0", "--load", str(folder / "ckpt")),
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
        *("--rollout-max-response-len", "40", "--eval-temperature", "0"),
        *("--output-dir", str(folder / f"eval_{environment}")),
    ]


def main() -> int:
    """``python -m rlcore_megatron.tool_demo [FOLDER]``: prepare, warm start, GRPO, then score the
    held-out set with and without the calculator."""
    from rlcore_megatron.run import main as run_main

    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/tool_demo")
    prepare_tool_demo(folder)
    for argv in (
        tool_demo_flags(folder, "warm"),
        tool_demo_flags(folder, "grpo"),
        tool_demo_eval_flags(folder, "calculator"),
        tool_demo_eval_flags(folder, "no_calculator"),
    ):
        code = run_main(argv)
        if code:
            return code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
