"""The ``[rollout]`` and ``[multiturn]`` sections: how many rollouts, how big, how the engine
samples, how each rollout's groups are produced; multi-turn episodes and tools. Each section's
own invariants are beside it (:func:`rollout_problems`, :func:`multiturn_problems`).
"""

from __future__ import annotations

from typing import Literal

import attrs

from rlcore.config.fields import option, problem
from rlcore.engines import KNOWN_ENGINES
from rlcore.errors import ConfigProblem
from rlcore.specs import EnvRewardMode

__all__ = ["MultiTurnConfig", "RolloutConfig", "multiturn_problems", "rollout_problems"]

SurplusPolicy = Literal["drop", "keep"]


@attrs.frozen
class RolloutConfig:
    """How many rollouts, how big, and how the engine samples."""

    num_rollout: int | None = option(
        None, "--num-rollout", "rollouts to train; 0 = evaluate only (default: from --num-epoch)"
    )
    num_epoch: int | None = option(
        None, "--num-epoch", "passes over --prompt-data, used when --num-rollout is not given"
    )
    rollout_batch_size: int = option(8, "--rollout-batch-size", "prompts per rollout")
    n_samples_per_prompt: int = option(4, "--n-samples-per-prompt", "responses sampled per prompt")
    max_response_len: int = option(16, "--rollout-max-response-len", "max new tokens per response")
    max_prompt_len: int | None = option(
        None,
        "--rollout-max-prompt-len",
        "prompts of more tokens are dropped when the data is read (counted in the log; the run "
        "is refused when none is left); default: the model's maximum positions less "
        "--rollout-max-response-len",
    )
    temperature: float = option(
        1.0,
        "--rollout-temperature",
        "sampling temperature; training scores that policy: every log-prob and entropy is of "
        "softmax(logits / T), as in slime and verl (0 = greedy, scored at T = 1)",
    )
    top_p: float = option(1.0, "--rollout-top-p", "nucleus sampling threshold (1.0 = off)")
    top_k: int = option(0, "--rollout-top-k", "top-k sampling (0 = off)")
    engine: str = option(
        "embedded",
        "--rollout-engine",
        "the rollout engine, by name: embedded (HF, in the driver) or sglang (servers); "
        "engine-specific settings are below, under the engine's name",
        choices=tuple(KNOWN_ENGINES),
    )
    engine_options: object = attrs.field(
        default=None,
        metadata={
            "help": "the chosen engine's own settings (its flags, or its config-file section)"
        },
    )
    """The chosen engine's own settings, an instance of its options class (``None``: its
    defaults). Set from the engine's flags or its config-file section (``[sglang]``) by
    :func:`rlcore.config.flags.load_config`; see :mod:`rlcore.engines`."""
    rollout_function_path: str | None = option(
        None,
        "--rollout-function-path",
        "module:function replacing the default rollout (generate, reward, filter, top up)",
    )
    over_sampling_batch_size: int | None = option(
        None,
        "--over-sampling-batch-size",
        "prompts per generation round of dynamic sampling (default: --rollout-batch-size)",
    )
    dynamic_sampling_filter_path: str | None = option(
        None,
        "--dynamic-sampling-filter-path",
        "group filter module:function; rounds repeat until --rollout-batch-size groups pass "
        "(built-in: rlcore.rollout:check_reward_nonzero_std drops groups whose rewards all equal)",
    )
    over_sampling_surplus: SurplusPolicy = option(
        "drop",
        "--over-sampling-surplus",
        "groups that passed beyond --rollout-batch-size: drop them, or keep them for the next "
        "rollout (saved in checkpoints)",
    )
    dynamic_sampling_max_rounds: int = option(
        8,
        "--dynamic-sampling-max-rounds",
        "generation rounds one rollout may take before it stops with an error",
    )
    max_staleness: int = option(
        0,
        "--max-staleness",
        "how many policy versions a trained sample may lag behind the trainer: 0 = synchronous "
        "(generate, then train); 1 = one-step off-policy (rollout i+1 generates with weights i "
        "while step i trains; deterministic); K > 1 = a background generator that runs up to K "
        "versions ahead (implies --use-tis: the behaviour log-probs correct the update)",
    )
    partial_rollout: bool = option(
        False,
        "--partial-rollout",
        "with --max-staleness > 1: new weights interrupt in-flight generation at a token "
        "boundary and it continues from the tokens already made (default: in-flight rollouts "
        "finish with the weights they started with)",
    )
    use_fault_tolerance: bool = option(
        False,
        "--use-fault-tolerance",
        "restart an engine server that dies or stops answering (a few times, with backoff), give "
        "it the policy's current weights and resubmit the requests it held; for servers the run "
        "launches, with --max-staleness 0 (default: a dead server ends the run)",
    )


@attrs.frozen
class MultiTurnConfig:
    """Multi-turn episodes and tools (:mod:`rlcore.rollout.multiturn`): on when an environment or a
    custom generate function is given."""

    environment_path: str | None = option(
        None,
        "--environment-path",
        "module:function building each episode's environment from (prompt, tokenizer), e.g. an "
        "rlcore.rollout.tools.ToolEnvironment; makes every sample a multi-turn episode",
    )
    custom_generate_function_path: str | None = option(
        None,
        "--custom-generate-function-path",
        "async module:function (ctx, prompt) -> Generation generating one sample (slime's flag; "
        "default with --environment-path: rlcore.rollout.multiturn:run_episode)",
    )
    max_turns: int = option(4, "--max-turns", "model turns per episode at most")
    env_reward: EnvRewardMode = option(
        "ignore",
        "--env-reward",
        "the environment's reward: ignore it, replace the reward function's, or add to it",
    )

    @property
    def enabled(self) -> bool:
        """Whether samples are multi-turn episodes."""
        return self.environment_path is not None or self.custom_generate_function_path is not None


def rollout_problems(r: RolloutConfig) -> list[ConfigProblem]:
    """The section's own ranges: counts, sampling parameters, dynamic sampling."""
    problems: list[ConfigProblem] = []

    def add(name: str, message: str, hint: str = "", reads: tuple[str, ...] = ()) -> None:
        problems.append(problem(RolloutConfig, "rollout", name, message, hint, reads=reads))

    for name in ("num_rollout", "num_epoch"):
        value = getattr(r, name)
        if value is not None and value < 0:
            add(name, f"must be >= 0, got {value}")
    if r.num_epoch == 0:
        add("num_epoch", "must be >= 1", "use --num-rollout 0 to evaluate only")
    for name in ("rollout_batch_size", "n_samples_per_prompt", "max_response_len"):
        if getattr(r, name) < 1:
            add(name, f"must be >= 1, got {getattr(r, name)}")
    if r.temperature < 0:
        add("temperature", f"must be >= 0, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        add("top_p", f"must be in (0, 1], got {r.top_p}")
    if r.top_k < 0:
        add("top_k", f"must be >= 0, got {r.top_k}")
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
        add(
            "over_sampling_batch_size",
            f"{r.over_sampling_batch_size} is less than --rollout-batch-size "
            f"{r.rollout_batch_size}: a round must be able to fill the rollout",
            "raise it, or leave it out to use --rollout-batch-size",
            reads=("rollout.rollout_batch_size",),
        )
    if r.dynamic_sampling_max_rounds < 1:
        add(
            "dynamic_sampling_max_rounds",
            f"must be >= 1, got {r.dynamic_sampling_max_rounds}",
        )
    if r.max_prompt_len is not None and r.max_prompt_len < 1:
        add("max_prompt_len", f"must be >= 1, got {r.max_prompt_len}")
    if r.max_staleness < 0:
        add("max_staleness", f"must be >= 0, got {r.max_staleness}")
    if r.partial_rollout and r.max_staleness < 2:
        add(
            "partial_rollout",
            f"has no effect with --max-staleness {r.max_staleness}: weights change mid-generation "
            "only when a background generator runs more than one version ahead",
            "add --max-staleness 2 (or more), or drop --partial-rollout",
        )
    if r.use_fault_tolerance and r.max_staleness > 0:
        add(
            "use_fault_tolerance",
            f"cannot be combined with --max-staleness {r.max_staleness}: a restarted server must "
            "get the weights the others serve, and while the trainer runs ahead of the engine no "
            "process holds them any more",
            "drop --max-staleness (synchronous training), or drop --use-fault-tolerance",
        )
    return problems


def multiturn_problems(mt: MultiTurnConfig) -> list[ConfigProblem]:
    """The turn limit, and an environment reward mode without an environment."""
    problems: list[ConfigProblem] = []

    def add(name: str, message: str, hint: str = "") -> None:
        problems.append(problem(MultiTurnConfig, "multiturn", name, message, hint))

    if mt.max_turns < 1:
        add("max_turns", f"must be >= 1, got {mt.max_turns}")
    if mt.env_reward != "ignore" and not mt.enabled:
        add(
            "env_reward",
            f"is {mt.env_reward!r} but no episode has an environment",
            "give --environment-path or --custom-generate-function-path, or drop --env-reward",
        )
    return problems
