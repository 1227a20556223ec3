"""The self-contained demo that ``python -m rlcore.launch`` (and ``python -m rlcore_megatron.run``)
runs with no flags, or with ``--train-backend NAME`` alone.

Task: reverse a three-digit string (``"407>"`` -> ``"704"``), exact-match reward, 900 training
strings and 100 held-out ones. The answer depends on every character of the prompt, so a constant
output scores 0 on the held-out set (the collapse seen with partial-credit addition, where printing
``11111111`` scores 0.24, cannot happen here). A random tiny model never samples a whole correct
answer, so the run begins with a short supervised warm start (``--sft-warmup-rollouts``) that
leaves held-out greedy accuracy at 0.15-0.30, and then trains with GRPO, which takes it to 1.00.
After the warm start most sampled groups are all-wrong (no signal for GRPO), so the RL part
samples 32 prompts per round and keeps the groups whose rewards differ (DAPO's dynamic sampling,
``--dynamic-sampling-filter-path``); the learning rate decays from 1e-3 to 1e-4 (cosine) so the
last rollouts do not undo what was learned.

Everything is built locally (:mod:`rlcore.new_model`): a character tokenizer, a tiny Llama, the
data files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlcore.new_model import Sizes, build_char_tokenizer, build_model

__all__ = ["ALPHABET", "demo_flags", "opd_demo_flags", "prepare_demo"]

ALPHABET = "0123456789>"
NUM_STRINGS = 1000
HELD_OUT = 100


def _write_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare_demo(folder: Path, seed: int = 0) -> None:
    """Build the model, tokenizer and data under ``folder`` (idempotent: kept when present)."""
    model = folder / "model"
    if not (model / "config.json").is_file():
        tokenizer = build_char_tokenizer(model, ALPHABET)
        build_model(
            model,
            vocab_size=len(tokenizer),
            family="llama",
            sizes=Sizes(max_position_embeddings=64),  # 2 layers of width 64: the defaults
            seed=seed,
        )
    if not (folder / "eval.jsonl").is_file():
        rows = [{"prompt": f"{n:03d}>", "answer": f"{n:03d}"[::-1]} for n in range(NUM_STRINGS)]
        random.Random(seed).shuffle(rows)
        _write_jsonl(folder / "train.jsonl", rows[HELD_OUT:])
        _write_jsonl(folder / "eval.jsonl", rows[:HELD_OUT])


def demo_flags(folder: Path) -> list[str]:
    """The run's flags; print them with ``--help`` to see what each does."""
    return [
        "--hf-checkpoint",
        str(folder / "model"),
        "--prompt-data",
        str(folder / "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "answer",
        "--eval-prompt-data",
        "heldout",
        str(folder / "eval.jsonl"),
        "--rm-type",
        "exact_match",
        "--num-rollout",
        "160",
        "--sft-warmup-rollouts",
        "60",
        "--rollout-batch-size",
        "16",
        "--n-samples-per-prompt",
        "8",
        "--global-batch-size",
        "128",
        "--micro-batch-size",
        "128",
        "--rollout-max-response-len",
        "5",
        "--rollout-temperature",
        "1.0",
        "--lr",
        "1e-3",
        "--lr-decay-style",
        "cosine",
        "--min-lr",
        "1e-4",
        "--over-sampling-batch-size",
        "32",
        "--dynamic-sampling-filter-path",
        "rlcore.rollout.default:check_reward_nonzero_std",
        "--dynamic-sampling-max-rounds",
        "16",
        "--clip-grad",
        "1.0",
        "--eval-interval",
        "20",
        "--eval-temperature",
        "0",
        "--save",
        str(folder / "ckpt"),
        "--overwrite-save",  # a rerun of the demo replaces the previous one's checkpoints
        "--save-interval",
        "80",
        "--output-dir",
        str(folder / "run"),
        "--seed",
        "0",
    ]


def opd_demo_flags(folder: Path, teacher: Path, *, pure: bool = False) -> list[str]:
    """The demo's run as on-policy distillation (#25): the fresh model learns from ``teacher``
    (an rlcore checkpoint folder, e.g. the shipped demo's ``ckpt``) with no warm start, so no
    labels train it. ``pure``: ``--opd-only`` (no reward at all); otherwise each token's advantage
    is GRPO's on the exact-match reward minus the reverse KL to the teacher. No dynamic sampling:
    a fresh model's groups all score 0, and the teacher's signal is in every one of them."""
    flags = demo_flags(folder)
    flags[flags.index("--sft-warmup-rollouts") + 1] = "0"
    for flag in (
        "--over-sampling-batch-size",
        "--dynamic-sampling-filter-path",
        "--dynamic-sampling-max-rounds",
    ):
        del flags[flags.index(flag) : flags.index(flag) + 2]
    return [
        *flags,
        *("--use-opd", "--opd-teacher-load", str(teacher)),
        *(("--opd-only",) if pure else ()),
    ]
