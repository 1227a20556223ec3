"""Your own multi-turn task from scratch: a guessing game, with a tiny model built here.

    python examples/multiturn_task.py [FOLDER]     (default: runs/guess)

The model guesses a secret digit; the environment answers ``<`` (lower) or ``>`` (higher) until
the guess is right or the turns run out. The file builds a character tokenizer and a tiny Llama,
writes the prompts, trains two GRPO rollouts through ``python -m rlcore_megatron.run``'s
``main``, and prints one saved episode turn by turn. A real task changes the model and data
(``--hf-checkpoint``, ``--prompt-data``) and keeps the environment and reward shapes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rlcore.launch.cli import main
from rlcore.new_model import Sizes, build_char_tokenizer, build_model
from rlcore.protocols.tokenizer import Tokenizer
from rlcore.rollout.environments import StepResult
from rlcore.rollout.replay import load_rollout_data
from rlcore.samples import Generation, Prompt, Turn

ALPHABET = "0123456789<>?"  # every character a prompt, a turn or an observation uses
MODULE = Path(__file__).stem  # the flags name this file's functions: "multiturn_task:make_game"


class GuessingGame:
    """One episode's environment (``--environment-path``): built per prompt."""

    def __init__(self, secret: str, tokenizer: Tokenizer) -> None:
        self.secret, self.tokenizer = secret, tokenizer

    async def step(self, turn: Turn, /) -> StepResult:
        guess = turn.text.strip()  # the model's turn, without its <eos>
        if guess == self.secret:
            return StepResult(done=True)  # no observation: the episode ends
        hint = "<" if guess > self.secret else ">"
        # Observations are token ids in the middle of the conversation: of_text encodes them
        # without the <bos> that tokenizer.encode puts in front of a whole text.
        return StepResult.of_text(self.tokenizer, hint)


def make_game(prompt: Prompt, tokenizer: Tokenizer) -> GuessingGame:
    assert prompt.label is not None  # --label-key secret
    return GuessingGame(prompt.label, tokenizer)


def reward(prompt: Prompt, generation: Generation) -> float:
    """``--custom-rm-path``: 1 for a right last guess, less the more guesses it took."""
    guesses = [t for t in generation.turns if t.role == "model"]  # or "environment"
    right = bool(guesses) and guesses[-1].text.strip() == prompt.label
    return 1.0 / len(guesses) if right else 0.0


def run(folder: Path) -> int:
    tokenizer = build_char_tokenizer(folder / "model", ALPHABET)
    sizes = Sizes(hidden_size=32, num_layers=1)
    build_model(folder / "model", vocab_size=len(tokenizer), sizes=sizes)
    rows = [{"prompt": "?", "secret": str(n % 10)} for n in range(100)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(
        [
            *(
                "--hf-checkpoint",
                str(folder / "model"),
                "--prompt-data",
                str(folder / "train.jsonl"),
            ),
            *("--input-key", "prompt", "--label-key", "secret"),
            *("--environment-path", f"{MODULE}:make_game", "--max-turns", "4"),
            *("--custom-rm-path", f"{MODULE}:reward", "--rollout-max-response-len", "12"),
            *("--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"),
            *("--global-batch-size", "16", "--micro-batch-size", "16", "--lr", "1e-3"),
            *(
                "--save-debug-rollout-data",
                str(folder / "rollouts"),
                "--output-dir",
                str(folder / "run"),
            ),
        ]
    )
    if code:
        return code
    # Each saved rollout holds groups of samples; an episode's turns are in sample.response.
    sample = load_rollout_data(str(folder / "rollouts"), 1)[0][0]
    print(f"prompt {sample.prompt.text!r}, secret {sample.prompt.label}, reward {sample.reward}")
    for turn in sample.response.turns:
        print(f"  {turn.role:<11} {turn.text!r:<8} ids {list(turn.token_ids)}")
    print(f"  loss mask   {list(sample.response.loss_mask)} (0: observation tokens)")
    return 0


if __name__ == "__main__":  # run as a script, the file's folder is on sys.path: MODULE imports
    sys.exit(run(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/guess")))
