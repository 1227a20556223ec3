"""The ``[data]`` and ``[eval]`` sections: training prompts and the reward, eval sets and how
they are sampled; with the eval section's invariants (:func:`eval_problems`).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from rlcore.config.fields import option, problem
from rlcore.errors import ConfigProblem
from rlcore.specs import RewardName

__all__ = ["DataConfig", "EvalConfig", "EvalDataConfig", "eval_problems"]


@attrs.frozen
class DataConfig:
    """Training prompts and the reward."""

    prompt_data: Path | None = option(
        None, "--prompt-data", "training prompts (.jsonl or .parquet)"
    )
    input_key: str = option("input", "--input-key", "field holding the prompt")
    label_key: str = option("label", "--label-key", "field holding the reference answer")
    apply_chat_template: bool = option(
        False, "--apply-chat-template", "wrap prompts in the tokenizer's chat template"
    )
    rm_type: RewardName = option("exact_match", "--rm-type", "built-in reward: exact_match or math")
    custom_rm_path: str | None = option(
        None, "--custom-rm-path", "reward function as module:function (sync or async)"
    )


@attrs.frozen
class EvalDataConfig:
    """One eval set: ``--eval-prompt-data NAME PATH``."""

    name: str
    path: Path


@attrs.frozen
class EvalConfig:
    """Periodic evaluation with the rollout engine."""

    interval: int | None = option(
        None, "--eval-interval", "evaluate every N rollouts (and after the last)"
    )
    prompt_data: tuple[EvalDataConfig, ...] = option(
        (), "--eval-prompt-data", "eval sets as NAME PATH [NAME PATH ...]", pairs=True
    )
    skip_eval_before_train: bool = option(
        False, "--skip-eval-before-train", "no eval before the first rollout"
    )
    n_samples_per_eval_prompt: int = option(
        1, "--n-samples-per-eval-prompt", "samples per eval prompt (pass@k)"
    )
    max_response_len: int | None = option(
        None, "--eval-max-response-len", "default: --rollout-max-response-len"
    )
    temperature: float = option(0.0, "--eval-temperature", "eval sampling temperature (0 = greedy)")


def eval_problems(e: EvalConfig) -> list[ConfigProblem]:
    """Ranges, distinct set names, and eval data when evaluation is asked for."""
    problems: list[ConfigProblem] = []

    def add(name: str, message: str, hint: str = "", reads: tuple[str, ...] = ()) -> None:
        problems.append(problem(EvalConfig, "eval", name, message, hint, reads=reads))

    if e.interval is not None and e.interval < 1:
        add("interval", f"must be >= 1, got {e.interval}")
    if e.n_samples_per_eval_prompt < 1:
        add("n_samples_per_eval_prompt", f"must be >= 1, got {e.n_samples_per_eval_prompt}")
    if e.max_response_len is not None and e.max_response_len < 1:
        add("max_response_len", f"must be >= 1, got {e.max_response_len}")
    if e.temperature < 0:
        add("temperature", f"must be >= 0, got {e.temperature}")
    names = [d.name for d in e.prompt_data]
    if len(set(names)) != len(names):
        add("prompt_data", f"eval set names repeat: {names}", "give each set its own NAME")
    if e.interval is not None and not e.prompt_data:
        add(
            "prompt_data",
            "evaluation is asked for (--eval-interval) but there is no eval data",
            "add --eval-prompt-data NAME PATH",
            reads=("eval.interval",),
        )
    return problems
