"""The run configuration: frozen attrs classes behind one cattrs converter.

Two sources, one result: command-line flags with slime's names and a TOML file
(``--config run.toml``, sections named like the classes' fields below; flags override the file).
A :class:`RunConfig` that exists is valid: its constructor checks every invariant that would
otherwise fail later inside Megatron or mid-run and raises one :class:`~rlcore.errors.ConfigError`
listing *all* problems with their field paths (and flags) and what to do.

Every field's metadata carries its flag and a one-line help text; the CLI is generated from them.
Every ``float`` field must be a finite number (no field gives NaN or infinity a meaning).
"""

from __future__ import annotations

import difflib
import functools
import math
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from rlcore.engines import KNOWN_ENGINES, load_engine
from rlcore.errors import BackendUnavailableError, ConfigError, ConfigProblem
from rlcore.specs import (
    AdvantageEstimator,
    DecayStyle,
    ISLevel,
    ISMode,
    KLType,
    LossAggMode,
    batch_split_problem,
    expert_split_problem,
    parallel_split_problem,
    schedule_length_problem,
)

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "DebugConfig",
    "EvalConfig",
    "EvalDataConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OptimizerConfig",
    "RewardName",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "check",
    "converter",
    "float_fields",
    "option",
    "structure_config",
    "with_flag",
]

RewardName = Literal["exact_match", "math"]
"""The built-in rule rewards (:data:`rlcore.rewards.BUILTIN_REWARDS`)."""
SurplusPolicy = Literal["drop", "keep"]
EnvRewardMode = Literal["ignore", "replace", "add"]
"""How an environment's reward meets the reward function's (``--env-reward``)."""

_T = TypeVar("_T")


def option(default: _T, flag: str, help: str, **metadata: Any) -> _T:
    """An attrs field with its command-line flag and help text in the metadata (``repeat=True``:
    a repeatable flag; ``invert=True``: a flag that sets a bool to False). Engine packages
    declare their options with it too (see :mod:`rlcore.engines`)."""
    result: _T = attrs.field(default=default, metadata={"flag": flag, "help": help, **metadata})
    return result


_opt = option


# --------------------------------------------------------------------------------------------
# Sections


@attrs.frozen
class RolloutConfig:
    """How many rollouts, how big, and how the engine samples."""

    num_rollout: int | None = _opt(
        None, "--num-rollout", "rollouts to train; 0 = evaluate only (default: from --num-epoch)"
    )
    num_epoch: int | None = _opt(
        None, "--num-epoch", "passes over --prompt-data, used when --num-rollout is not given"
    )
    rollout_batch_size: int = _opt(8, "--rollout-batch-size", "prompts per rollout")
    n_samples_per_prompt: int = _opt(4, "--n-samples-per-prompt", "responses sampled per prompt")
    max_response_len: int = _opt(16, "--rollout-max-response-len", "max new tokens per response")
    temperature: float = _opt(1.0, "--rollout-temperature", "sampling temperature")
    top_p: float = _opt(1.0, "--rollout-top-p", "nucleus sampling threshold (1.0 = off)")
    top_k: int = _opt(0, "--rollout-top-k", "top-k sampling (0 = off)")
    engine: str = _opt(
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
    :func:`rlcore.flags.load_config`; see :mod:`rlcore.engines`."""
    rollout_function_path: str | None = _opt(
        None,
        "--rollout-function-path",
        "module:function replacing the default rollout (generate, reward, filter, top up)",
    )
    over_sampling_batch_size: int | None = _opt(
        None,
        "--over-sampling-batch-size",
        "prompts per generation round of dynamic sampling (default: --rollout-batch-size)",
    )
    dynamic_sampling_filter_path: str | None = _opt(
        None,
        "--dynamic-sampling-filter-path",
        "group filter module:function; rounds repeat until --rollout-batch-size groups pass "
        "(built-in: rlcore.rollout:check_reward_nonzero_std drops groups whose rewards all equal)",
    )
    over_sampling_surplus: SurplusPolicy = _opt(
        "drop",
        "--over-sampling-surplus",
        "groups that passed beyond --rollout-batch-size: drop them, or keep them for the next "
        "rollout (saved in checkpoints)",
    )
    dynamic_sampling_max_rounds: int = _opt(
        8,
        "--dynamic-sampling-max-rounds",
        "generation rounds one rollout may take before it stops with an error",
    )


@attrs.frozen
class AlgorithmConfig:
    """Advantage estimation, policy loss, KL."""

    advantage_estimator: AdvantageEstimator = _opt(
        "grpo",
        "--advantage-estimator",
        "grpo, gspo (sequence-level ratio), reinforce_plus_plus, reinforce_plus_plus_baseline "
        "or ppo",
    )
    use_critic: bool = _opt(
        False, "--use-critic", "train a critic (implied by --advantage-estimator ppo)"
    )
    gamma: float = _opt(1.0, "--gamma", "discount factor (PPO/GAE, REINFORCE++)")
    lambd: float = _opt(1.0, "--lambd", "GAE lambda")
    normalize_std: bool = _opt(
        True,
        "--disable-grpo-std-normalization",
        "Dr. GRPO: do not divide by the group std",
        invert=True,
    )
    normalize_advantages: bool = _opt(
        False,
        "--normalize-advantages",
        "whiten advantages over the rollout's response tokens (usual for PPO)",
    )
    kl_coef: float = _opt(0.0, "--kl-coef", "KL penalty on the reward (needs a reference model)")
    kl_penalty_type: KLType = _opt("k1", "--kl-penalty-type", "KL estimator for --kl-coef")
    use_kl_loss: bool = _opt(False, "--use-kl-loss", "add a KL loss against the reference model")
    kl_loss_coef: float = _opt(0.0, "--kl-loss-coef", "weight of the KL loss")
    kl_loss_type: KLType = _opt("low_var_kl", "--kl-loss-type", "k1, k2, k3 or low_var_kl")
    eps_clip: float = _opt(0.2, "--eps-clip", "PPO clip range below 1")
    eps_clip_high: float | None = _opt(
        None, "--eps-clip-high", "PPO clip range above 1 (default: --eps-clip)"
    )
    value_clip: float = _opt(0.2, "--value-clip", "critic value clip range")
    entropy_coef: float = _opt(0.0, "--entropy-coef", "entropy bonus weight")
    loss_agg_mode: LossAggMode = _opt(
        "seq-mean-token-mean",
        "--loss-agg-mode",
        "seq-mean-token-mean (GRPO), token-mean (DAPO) or seq-mean-token-sum-norm (Dr. GRPO: "
        "token sums over --rollout-max-response-len)",
    )
    calculate_per_token_loss: bool = _opt(
        False, "--calculate-per-token-loss", "slime's name for --loss-agg-mode token-mean"
    )
    use_rollout_logprobs: bool = _opt(
        False,
        "--use-rollout-logprobs",
        "PPO's old log-probs are the rollout engine's (no trainer recompute)",
    )
    use_tis: bool = _opt(
        False,
        "--use-tis",
        "reweight each token's policy loss by the trainer/engine probability ratio (TIS)",
    )
    tis_clip: float = _opt(2.0, "--tis-clip", "upper bound of the importance weight")
    tis_clip_low: float = _opt(0.0, "--tis-clip-low", "lower bound of the importance weight")
    tis_mode: ISMode = _opt(
        "clip",
        "--tis-mode",
        "clip (TIS: clamp to the bounds) or mask (IcePop/MIS: weight 0 outside them)",
    )
    tis_level: ISLevel = _opt(
        "token",
        "--tis-level",
        "token, or geometric: one weight per sequence from the geometric mean of its ratios",
    )
    tis_veto_threshold: float | None = _opt(
        None,
        "--tis-veto-threshold",
        "weight 0 for every token of a sequence with any token ratio below this",
    )
    custom_tis_function_path: str | None = _opt(
        None,
        "--custom-tis-function-path",
        "module:function computing the importance weights instead",
    )
    sft_warmup_rollouts: int = _opt(
        0,
        "--sft-warmup-rollouts",
        "first N rollouts train on the labels (supervised warm start), not on samples",
    )

    @property
    def critic(self) -> bool:
        """Whether a critic is trained: asked for, or implied by PPO (as in slime)."""
        return self.use_critic or self.advantage_estimator == "ppo"

    @property
    def uses_kl(self) -> bool:
        """Whether a reference model is needed: a KL reward penalty or a KL loss."""
        return self.kl_coef != 0.0 or self.use_kl_loss

    @property
    def agg_mode(self) -> LossAggMode:
        """``--loss-agg-mode``, or ``token-mean`` for ``--calculate-per-token-loss``."""
        return "token-mean" if self.calculate_per_token_loss else self.loss_agg_mode


@attrs.frozen
class OptimizerConfig:
    """AdamW and its learning-rate schedule (in optimizer steps)."""

    lr: float = _opt(1e-6, "--lr", "peak learning rate")
    critic_lr: float | None = _opt(None, "--critic-lr", "critic learning rate (default: --lr)")
    min_lr: float = _opt(0.0, "--min-lr", "learning rate at the end of decay")
    lr_warmup_iters: int = _opt(0, "--lr-warmup-iters", "linear warmup steps")
    lr_decay_iters: int | None = _opt(
        None, "--lr-decay-iters", "decay steps (default: all optimizer steps of the run)"
    )
    lr_decay_style: DecayStyle = _opt(
        "constant", "--lr-decay-style", "constant, linear, cosine, inverse-square-root"
    )
    clip_grad: float = _opt(1.0, "--clip-grad", "global gradient-norm clip (0 = off)")
    weight_decay: float = _opt(0.0, "--weight-decay", "AdamW weight decay")
    adam_beta1: float = _opt(0.9, "--adam-beta1", "AdamW beta1")
    adam_beta2: float = _opt(0.999, "--adam-beta2", "AdamW beta2")
    use_distributed_optimizer: bool = _opt(
        False,
        "--use-distributed-optimizer",
        "shard optimizer state and fp32 main weights over data-parallel ranks (ZeRO-1)",
    )


@attrs.frozen
class TrainConfig:
    """How a rollout's samples are cut into optimizer steps and micro-batches."""

    global_batch_size: int = _opt(32, "--global-batch-size", "samples per optimizer step")
    micro_batch_size: int = _opt(8, "--micro-batch-size", "samples per forward/backward per rank")


@attrs.frozen
class ModelConfig:
    """Which model, and how it is split over ranks."""

    hf_checkpoint: Path | None = _opt(
        None, "--hf-checkpoint", "HF model folder (config.json + safetensors)"
    )
    tensor_model_parallel_size: int = _opt(
        1, "--tensor-model-parallel-size", "tensor-parallel ranks"
    )
    expert_model_parallel_size: int = _opt(
        1, "--expert-model-parallel-size", "expert-parallel ranks (MoE models share experts out)"
    )
    moe_aux_loss_coeff: float = _opt(
        0.0, "--moe-aux-loss-coeff", "MoE router load-balancing loss weight (0 = off)"
    )
    bf16: bool = _opt(
        False,
        "--bf16",
        "bf16 weights and activations (fp32 main weights, optimizer state and gradient "
        "reduction); the rollout engine runs in bf16 too (default: fp32)",
    )


@attrs.frozen
class ClusterConfig:
    """Where ranks and rollout servers run: slime's flags, with slime's meaning.

    One rank per GPU; on a cluster without GPUs, one rank per CPU slot (a logical CPU), and the
    actor's, critic's and reference model's ranks share their slots (they take turns in the loop).
    """

    actor_num_nodes: int = _opt(1, "--actor-num-nodes", "nodes for the actor's ranks")
    actor_num_gpus_per_node: int = _opt(
        1, "--actor-num-gpus-per-node", "actor ranks (GPUs, or CPU slots) per node"
    )
    critic_num_nodes: int | None = _opt(
        None, "--critic-num-nodes", "nodes for the critic's ranks (default: --actor-num-nodes)"
    )
    critic_num_gpus_per_node: int | None = _opt(
        None,
        "--critic-num-gpus-per-node",
        "critic ranks per node (default: --actor-num-gpus-per-node)",
    )
    rollout_num_gpus: int | None = _opt(
        None,
        "--rollout-num-gpus",
        "GPUs (or CPU slots) for rollout servers in all (default: the actor's with --colocate, "
        "else one engine's)",
    )
    rollout_num_gpus_per_engine: int = _opt(
        1, "--rollout-num-gpus-per-engine", "GPUs per rollout server (its tensor-parallel size)"
    )
    colocate: bool = _opt(
        False, "--colocate", "rollout servers share the actor's GPUs (else they get their own)"
    )

    @property
    def actor_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def critic_ranks(self) -> int:
        nodes = self.critic_num_nodes or self.actor_num_nodes
        return nodes * (self.critic_num_gpus_per_node or self.actor_num_gpus_per_node)

    @property
    def rollout_gpus(self) -> int:
        """GPUs (or CPU slots) the rollout servers take, when the engine runs servers."""
        if self.rollout_num_gpus is not None:
            return self.rollout_num_gpus
        return self.actor_ranks if self.colocate else self.rollout_num_gpus_per_engine


@attrs.frozen
class DataConfig:
    """Training prompts and the reward."""

    prompt_data: Path | None = _opt(None, "--prompt-data", "training prompts (.jsonl or .parquet)")
    input_key: str = _opt("input", "--input-key", "field holding the prompt")
    label_key: str = _opt("label", "--label-key", "field holding the reference answer")
    apply_chat_template: bool = _opt(
        False, "--apply-chat-template", "wrap prompts in the tokenizer's chat template"
    )
    rm_type: RewardName = _opt("exact_match", "--rm-type", "built-in reward: exact_match or math")
    custom_rm_path: str | None = _opt(
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

    interval: int | None = _opt(
        None, "--eval-interval", "evaluate every N rollouts (and after the last)"
    )
    prompt_data: tuple[EvalDataConfig, ...] = _opt(
        (), "--eval-prompt-data", "eval sets as NAME PATH [NAME PATH ...]", pairs=True
    )
    skip_eval_before_train: bool = _opt(
        False, "--skip-eval-before-train", "no eval before the first rollout"
    )
    n_samples_per_eval_prompt: int = _opt(
        1, "--n-samples-per-eval-prompt", "samples per eval prompt (pass@k)"
    )
    max_response_len: int | None = _opt(
        None, "--eval-max-response-len", "default: --rollout-max-response-len"
    )
    temperature: float = _opt(0.0, "--eval-temperature", "eval sampling temperature (0 = greedy)")


@attrs.frozen
class CheckpointConfig:
    """Saving and resuming."""

    save: Path | None = _opt(None, "--save", "checkpoint folder")
    save_interval: int | None = _opt(
        None, "--save-interval", "save every N rollouts (and always after the last)"
    )
    load: Path | None = _opt(
        None, "--load", "checkpoint folder (or one rollout_* inside it) to resume from"
    )
    start_rollout_id: int | None = _opt(
        None, "--start-rollout-id", "first rollout id (default: loaded checkpoint's id + 1, else 0)"
    )


@attrs.frozen
class MultiTurnConfig:
    """Multi-turn episodes and tools (:mod:`rlcore.multiturn`): on when an environment or a
    custom generate function is given."""

    environment_path: str | None = _opt(
        None,
        "--environment-path",
        "module:function building each episode's environment from (prompt, tokenizer), e.g. an "
        "rlcore.tools.ToolEnvironment; makes every sample a multi-turn episode",
    )
    custom_generate_function_path: str | None = _opt(
        None,
        "--custom-generate-function-path",
        "async module:function (ctx, prompt) -> Generation generating one sample (slime's flag; "
        "default with --environment-path: rlcore.multiturn:run_episode)",
    )
    max_turns: int = _opt(4, "--max-turns", "model turns per episode at most")
    env_reward: EnvRewardMode = _opt(
        "ignore",
        "--env-reward",
        "the environment's reward: ignore it, replace the reward function's, or add to it",
    )

    @property
    def enabled(self) -> bool:
        """Whether samples are multi-turn episodes."""
        return self.environment_path is not None or self.custom_generate_function_path is not None


@attrs.frozen
class DebugConfig:
    """Saving and replaying rollouts, and running one half of the loop (slime's debug flags)."""

    save_debug_rollout_data: str | None = _opt(
        None,
        "--save-debug-rollout-data",
        "write each rollout's samples to PATH, '{rollout_id}' replaced by the id "
        "(without it, PATH is a folder of rollout_NNNNNN.json files)",
    )
    load_debug_rollout_data: str | None = _opt(
        None,
        "--load-debug-rollout-data",
        "train on rollouts saved by --save-debug-rollout-data; no rollout engine is built",
    )
    debug_rollout_only: bool = _opt(
        False,
        "--debug-rollout-only",
        "generate (and save) rollouts without building any training stack",
    )
    debug_train_only: bool = _opt(
        False,
        "--debug-train-only",
        "train only, on --load-debug-rollout-data: no rollout engine, no eval",
    )

    @property
    def replays(self) -> bool:
        """Whether training reads saved rollouts instead of generating (no engine)."""
        return self.load_debug_rollout_data is not None or self.debug_train_only


@attrs.frozen
class RunConfig:
    """Everything a run needs. Constructing one checks every cross-field invariant (see
    :func:`check`)."""

    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    optim: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    model: ModelConfig = ModelConfig()
    cluster: ClusterConfig = ClusterConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    debug: DebugConfig = DebugConfig()
    multiturn: MultiTurnConfig = MultiTurnConfig()
    seed: int = _opt(1234, "--seed", "random seed")
    output_dir: Path = _opt(Path("runs/latest"), "--output-dir", "run folder for metrics and logs")
    use_tensorboard: bool = _opt(False, "--use-tensorboard", "also write TensorBoard events")
    use_wandb: bool = _opt(False, "--use-wandb", "also log to Weights & Biases (offline works)")
    ray_address: str | None = _opt(
        None, "--ray-address", "join a Ray cluster (default: start a local one)"
    )

    def __attrs_post_init__(self) -> None:
        problems = check(self)
        if problems:
            raise ConfigError(problems)

    @property
    def is_eval_only(self) -> bool:
        return self.rollout.num_rollout == 0

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout: one per global batch."""
        return self.samples_per_rollout // self.train.global_batch_size

    @property
    def total_train_steps(self) -> int:
        return (self.rollout.num_rollout or 0) * self.steps_per_rollout

    @property
    def lr_decay_steps(self) -> int:
        """``--lr-decay-iters`` or, by default, every optimizer step of the run."""
        if self.optim.lr_decay_iters is not None:
            return self.optim.lr_decay_iters
        return self.total_train_steps


# --------------------------------------------------------------------------------------------
# Invariants


def _flag(section: type[Any], name: str) -> str:
    meta = attrs.fields_dict(section)[name].metadata
    return str(meta.get("flag", name))


def _problem(
    section: type[Any], prefix: str, name: str, message: str, hint: str = ""
) -> ConfigProblem:
    path = f"{prefix}.{name}" if prefix else name
    return ConfigProblem(path=f"{path} ({_flag(section, name)})", message=message, hint=hint)


@functools.cache
def float_fields() -> tuple[tuple[str, type[Any], str], ...]:
    """``(section, section class, field name)`` of every ``float`` (or ``float | None``) field;
    section ``""`` is :class:`RunConfig` itself."""
    out: list[tuple[str, type[Any], str]] = []
    sections = typing.get_type_hints(RunConfig)
    owners: list[tuple[str, type[Any]]] = [("", RunConfig)]
    owners += [(name, hint) for name, hint in sections.items() if attrs.has(hint)]
    for prefix, owner in owners:
        for name, hint in typing.get_type_hints(owner).items():
            if hint is float or hint == float | None:
                out.append((prefix, owner, name))
    return tuple(out)


def _non_finite(config: RunConfig) -> list[ConfigProblem]:
    problems = []
    for prefix, owner, name in float_fields():
        value = getattr(getattr(config, prefix) if prefix else config, name)
        if value is not None and not math.isfinite(value):
            problems.append(_problem(owner, prefix, name, f"must be a finite number, got {value}"))
    return problems


def check(config: RunConfig) -> list[ConfigProblem]:
    """Every problem with ``config``, in field order; empty when it can run.

    A NaN or infinite number is reported alone (with every other one): the invariants that
    compare numbers would otherwise blame a neighbouring field (``lr = nan`` fails ``min_lr <=
    lr``)."""
    problems: list[ConfigProblem] = _non_finite(config)
    if problems:
        return problems
    r, t, m, e, c = (
        config.rollout,
        config.train,
        config.model,
        config.eval,
        config.checkpoint,
    )

    def add(section: type[Any], prefix: str, name: str, message: str, hint: str = "") -> None:
        problems.append(_problem(section, prefix, name, message, hint))

    problems += _check_engine_and_cluster(config)
    mt = config.multiturn
    if mt.max_turns < 1:
        add(MultiTurnConfig, "multiturn", "max_turns", f"must be >= 1, got {mt.max_turns}")
    if mt.env_reward != "ignore" and not mt.enabled:
        add(
            MultiTurnConfig,
            "multiturn",
            "env_reward",
            f"is {mt.env_reward!r} but no episode has an environment",
            "give --environment-path or --custom-generate-function-path, or drop --env-reward",
        )

    # Counts.
    for name in ("num_rollout", "num_epoch"):
        value = getattr(r, name)
        if value is not None and value < 0:
            add(RolloutConfig, "rollout", name, f"must be >= 0, got {value}")
    if r.num_epoch == 0:
        add(
            RolloutConfig,
            "rollout",
            "num_epoch",
            "must be >= 1",
            "use --num-rollout 0 to evaluate only",
        )
    for name in ("rollout_batch_size", "n_samples_per_prompt", "max_response_len"):
        if getattr(r, name) < 1:
            add(RolloutConfig, "rollout", name, f"must be >= 1, got {getattr(r, name)}")
    if r.temperature < 0:
        add(RolloutConfig, "rollout", "temperature", f"must be >= 0, got {r.temperature}")
    if not 0 < r.top_p <= 1:
        add(RolloutConfig, "rollout", "top_p", f"must be in (0, 1], got {r.top_p}")
    if r.top_k < 0:
        add(RolloutConfig, "rollout", "top_k", f"must be >= 0, got {r.top_k}")
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
        add(
            RolloutConfig,
            "rollout",
            "over_sampling_batch_size",
            f"{r.over_sampling_batch_size} is less than --rollout-batch-size "
            f"{r.rollout_batch_size}: a round must be able to fill the rollout",
            "raise it, or leave it out to use --rollout-batch-size",
        )
    if r.dynamic_sampling_max_rounds < 1:
        add(
            RolloutConfig,
            "rollout",
            "dynamic_sampling_max_rounds",
            f"must be >= 1, got {r.dynamic_sampling_max_rounds}",
        )
    for name in ("global_batch_size", "micro_batch_size"):
        if getattr(t, name) < 1:
            add(TrainConfig, "train", name, f"must be >= 1, got {getattr(t, name)}")
    for name in (
        "tensor_model_parallel_size",
        "expert_model_parallel_size",
    ):
        if getattr(m, name) < 1:
            add(ModelConfig, "model", name, f"must be >= 1, got {getattr(m, name)}")
    if not m.moe_aux_loss_coeff >= 0:
        add(ModelConfig, "model", "moe_aux_loss_coeff", f"must be >= 0, got {m.moe_aux_loss_coeff}")
    if e.interval is not None and e.interval < 1:
        add(EvalConfig, "eval", "interval", f"must be >= 1, got {e.interval}")
    if e.n_samples_per_eval_prompt < 1:
        add(
            EvalConfig,
            "eval",
            "n_samples_per_eval_prompt",
            f"must be >= 1, got {e.n_samples_per_eval_prompt}",
        )
    if e.max_response_len is not None and e.max_response_len < 1:
        add(EvalConfig, "eval", "max_response_len", f"must be >= 1, got {e.max_response_len}")
    if e.temperature < 0:
        add(EvalConfig, "eval", "temperature", f"must be >= 0, got {e.temperature}")
    names = [d.name for d in e.prompt_data]
    if len(set(names)) != len(names):
        add(
            EvalConfig,
            "eval",
            "prompt_data",
            f"eval set names repeat: {names}",
            "give each set its own NAME",
        )
    if c.save_interval is not None and c.save_interval < 1:
        add(CheckpointConfig, "checkpoint", "save_interval", f"must be >= 1, got {c.save_interval}")
    if c.start_rollout_id is not None and c.start_rollout_id < 0:
        add(
            CheckpointConfig,
            "checkpoint",
            "start_rollout_id",
            f"must be >= 0, got {c.start_rollout_id}",
        )

    # What the run is asked to do.
    if e.interval is not None and not e.prompt_data:
        add(
            EvalConfig,
            "eval",
            "prompt_data",
            "evaluation is asked for (--eval-interval) but there is no eval data",
            "add --eval-prompt-data NAME PATH",
        )
    if c.save_interval is not None and c.save is None:
        add(
            CheckpointConfig,
            "checkpoint",
            "save",
            "--save-interval is set but there is no save folder",
            "add --save DIR",
        )
    tp, ep = m.tensor_model_parallel_size, m.expert_model_parallel_size
    if min(tp, ep) >= 1 and not _problems_in(problems, "cluster."):
        for role, ranks in _ranks_by_role(config).items():
            split = parallel_split_problem(tp, ranks)
            if split:
                add(
                    ModelConfig,
                    "model",
                    "tensor_model_parallel_size",
                    f"the {role}'s ranks: {split}",
                    f"make --{role}-num-nodes x --{role}-num-gpus-per-node a multiple of it",
                )
                continue
            experts = expert_split_problem(ep, tp, ranks)
            if experts:
                add(
                    ModelConfig,
                    "model",
                    "expert_model_parallel_size",
                    f"the {role}'s ranks: {experts}",
                    f"make --{role}-num-nodes x --{role}-num-gpus-per-node a multiple of "
                    "--expert-model-parallel-size x --tensor-model-parallel-size",
                )

    problems += _check_debug(config)
    if r.num_rollout is None and r.num_epoch is None:
        add(
            RolloutConfig,
            "rollout",
            "num_rollout",
            "neither --num-rollout nor --num-epoch is given",
            "set --num-rollout N (0 evaluates only)",
        )
    elif r.num_rollout == 0:
        if not e.prompt_data:
            add(
                RolloutConfig,
                "rollout",
                "num_rollout",
                "0 means evaluate only, but there is nothing to evaluate",
                "add --eval-prompt-data NAME PATH, or train with --num-rollout N > 0",
            )
    else:
        problems += _check_training(config)
    return problems


def _check_debug(config: RunConfig) -> list[ConfigProblem]:
    """The debug flags: which combinations mean something."""
    problems: list[ConfigProblem] = []
    d, e = config.debug, config.eval

    def add(name: str, message: str, hint: str = "") -> None:
        problems.append(_problem(DebugConfig, "debug", name, message, hint))

    if d.debug_rollout_only and d.replays:
        add(
            "debug_rollout_only",
            "cannot be combined with --debug-train-only or --load-debug-rollout-data",
            "generate with --debug-rollout-only, replay in another run",
        )
    if d.debug_train_only and d.load_debug_rollout_data is None:
        add(
            "debug_train_only",
            "trains on saved rollouts, but --load-debug-rollout-data is not given",
            "add --load-debug-rollout-data PATH (written by --save-debug-rollout-data)",
        )
    if d.load_debug_rollout_data is not None and d.save_debug_rollout_data is not None:
        add(
            "save_debug_rollout_data",
            "a run that replays saved rollouts generates none to save",
            "drop --save-debug-rollout-data",
        )
    if (d.debug_rollout_only or d.replays) and config.is_eval_only:
        add(
            "debug_rollout_only" if d.debug_rollout_only else "load_debug_rollout_data",
            "--num-rollout 0 evaluates only; the debug flags need rollouts",
            "set --num-rollout N > 0",
        )
    if d.replays and e.interval is not None:
        add(
            "load_debug_rollout_data",
            "a replaying run builds no rollout engine, so it cannot evaluate (--eval-interval)",
            "drop --eval-interval",
        )
    return problems


def _check_correction(config: RunConfig) -> list[ConfigProblem]:
    """The mismatch-correction and loss-aggregation flags."""
    problems: list[ConfigProblem] = []
    a = config.algorithm

    def add(name: str, message: str, hint: str = "") -> None:
        problems.append(_problem(AlgorithmConfig, "algorithm", name, message, hint))

    if a.use_tis and a.use_rollout_logprobs:
        add(
            "use_tis",
            "cannot be combined with --use-rollout-logprobs: with the engine's log-probs as the "
            "old ones there is no trainer/engine ratio left to correct",
            "choose one (as slime requires)",
        )
    if not 0.0 <= a.tis_clip_low <= 1.0 <= a.tis_clip:
        add(
            "tis_clip",
            f"the bounds must satisfy 0 <= --tis-clip-low <= 1 <= --tis-clip, got "
            f"{a.tis_clip_low} and {a.tis_clip}",
            "a weight range without 1 would reweight tokens on which engine and trainer agree",
        )
    if a.tis_veto_threshold is not None and not 0.0 < a.tis_veto_threshold < 1.0:
        add("tis_veto_threshold", f"must be in (0, 1), got {a.tis_veto_threshold}")
    if not a.use_tis:
        given = [
            name
            for name, value, default in (
                ("tis_mode", a.tis_mode, "clip"),
                ("tis_level", a.tis_level, "token"),
                ("tis_veto_threshold", a.tis_veto_threshold, None),
                ("custom_tis_function_path", a.custom_tis_function_path, None),
            )
            if value != default
        ]
        for name in given:
            add(name, "has no effect without --use-tis", "add --use-tis or drop it")
    if a.calculate_per_token_loss and a.loss_agg_mode != "seq-mean-token-mean":
        add(
            "calculate_per_token_loss",
            f"is --loss-agg-mode token-mean, but --loss-agg-mode {a.loss_agg_mode} is also given",
            "give one of the two",
        )
    return problems


def _check_training(config: RunConfig) -> list[ConfigProblem]:
    """Invariants that only matter when the run trains."""
    problems: list[ConfigProblem] = []
    r, a, o, t, m, c = (
        config.rollout,
        config.algorithm,
        config.optim,
        config.train,
        config.model,
        config.checkpoint,
    )

    def add(section: type[Any], prefix: str, name: str, message: str, hint: str = "") -> None:
        problems.append(_problem(section, prefix, name, message, hint))

    problems += _check_correction(config)
    if (
        a.advantage_estimator in ("grpo", "gspo", "reinforce_plus_plus_baseline")
        and r.n_samples_per_prompt < 2
    ):
        add(
            RolloutConfig,
            "rollout",
            "n_samples_per_prompt",
            f"{a.advantage_estimator} compares samples within a prompt's group, so it needs >= 2",
            "raise --n-samples-per-prompt",
        )
    if not 0 <= a.sft_warmup_rollouts < (r.num_rollout or 1):
        add(
            AlgorithmConfig,
            "algorithm",
            "sft_warmup_rollouts",
            "must be in [0, num_rollout) so that some rollouts use RL, "
            f"got {a.sft_warmup_rollouts}",
        )
    if a.kl_coef < 0 or a.kl_loss_coef < 0:
        add(
            AlgorithmConfig,
            "algorithm",
            "kl_coef" if a.kl_coef < 0 else "kl_loss_coef",
            "must be >= 0",
        )
    if a.eps_clip < 0 or (a.eps_clip_high is not None and a.eps_clip_high < 0):
        add(AlgorithmConfig, "algorithm", "eps_clip", "clip ranges must be >= 0")
    if not 0 <= a.gamma <= 1 or not 0 <= a.lambd <= 1:
        add(
            AlgorithmConfig,
            "algorithm",
            "gamma",
            f"gamma and lambd must be in [0, 1], got {a.gamma}, {a.lambd}",
        )
    if o.lr <= 0:
        add(OptimizerConfig, "optim", "lr", f"must be > 0, got {o.lr}")
    if o.critic_lr is not None and o.critic_lr <= 0:
        add(OptimizerConfig, "optim", "critic_lr", f"must be > 0, got {o.critic_lr}")
    if not 0 <= o.min_lr <= max(o.lr, o.critic_lr or 0.0):
        add(OptimizerConfig, "optim", "min_lr", f"must be in [0, lr], got {o.min_lr}")
    if o.clip_grad < 0:
        add(OptimizerConfig, "optim", "clip_grad", f"must be >= 0, got {o.clip_grad}")
    if o.lr_warmup_iters < 0:
        add(OptimizerConfig, "optim", "lr_warmup_iters", f"must be >= 0, got {o.lr_warmup_iters}")

    samples = config.samples_per_rollout
    if t.global_batch_size >= 1 and samples >= 1:
        if samples < t.global_batch_size:
            add(
                TrainConfig,
                "train",
                "global_batch_size",
                f"{t.global_batch_size} is more than the {samples} samples a rollout makes "
                f"(rollout_batch_size x n_samples_per_prompt), so no optimizer step would run",
                "lower --global-batch-size or raise --rollout-batch-size",
            )
        elif samples % t.global_batch_size:
            add(
                TrainConfig,
                "train",
                "global_batch_size",
                f"does not divide the {samples} samples per rollout",
                "pick a divisor",
            )
        if (
            r.rollout_batch_size >= 1
            and r.n_samples_per_prompt >= 1
            and t.global_batch_size % r.n_samples_per_prompt
        ):
            add(
                TrainConfig,
                "train",
                "global_batch_size",
                f"{t.global_batch_size} splits a prompt's group of "
                f"{r.n_samples_per_prompt} samples",
                "use a multiple of --n-samples-per-prompt",
            )
    tp = m.tensor_model_parallel_size
    sizes_valid = min(t.global_batch_size, t.micro_batch_size, tp) >= 1
    for role, ranks in _ranks_by_role(config).items():
        if sizes_valid and ranks >= 1 and not parallel_split_problem(tp, ranks):
            # TrainSpec's own rule, so that a config that passes plans into valid TrainSpecs.
            split = batch_split_problem(t.global_batch_size, t.micro_batch_size, ranks // tp)
            if split:
                add(
                    TrainConfig,
                    "train",
                    "micro_batch_size",
                    f"the {role}'s {split}",
                    "pick sizes that divide",
                )

    if r.num_rollout is not None and r.num_rollout > 0 and not problems:
        # LRSchedule's own rule, applied to the steps the plan will give it.
        decay = config.lr_decay_steps
        length = schedule_length_problem(o.lr_warmup_iters, decay)
        if length and length[0] == "decay_steps":
            add(
                OptimizerConfig,
                "optim",
                "lr_decay_iters",
                f"the run would decay the LR over {decay} optimizer steps: {length[1]}",
                "give --lr-decay-iters or train more samples",
            )
        elif length:
            add(
                OptimizerConfig,
                "optim",
                "lr_warmup_iters",
                f"warmup ({o.lr_warmup_iters}) must be shorter than decay ({decay} steps)",
                "lower --lr-warmup-iters or raise --lr-decay-iters",
            )
    if (
        c.start_rollout_id is not None
        and r.num_rollout is not None
        and c.start_rollout_id >= r.num_rollout > 0
    ):
        add(
            CheckpointConfig,
            "checkpoint",
            "start_rollout_id",
            f"{c.start_rollout_id} leaves nothing to train out of {r.num_rollout} rollouts",
            "lower --start-rollout-id or raise --num-rollout",
        )
    return problems


def _ranks_by_role(config: RunConfig) -> dict[str, int]:
    """The rank count of each trained (or scored) model with its own ranks: the actor, and the
    critic when there is one (the reference model is split like the actor)."""
    ranks = {"actor": config.cluster.actor_ranks}
    if config.algorithm.critic:
        ranks["critic"] = config.cluster.critic_ranks
    return ranks


def _problems_in(problems: list[ConfigProblem], prefix: str) -> bool:
    return any(p.path.startswith(prefix) for p in problems)


def _check_engine_and_cluster(config: RunConfig) -> list[ConfigProblem]:
    """The engine's name and options, and the placement counts."""
    problems: list[ConfigProblem] = []
    r, k = config.rollout, config.cluster

    def add(section: type[Any], prefix: str, name: str, message: str, hint: str = "") -> None:
        problems.append(_problem(section, prefix, name, message, hint))

    runs_servers = False
    if r.engine not in KNOWN_ENGINES:
        add(
            RolloutConfig,
            "rollout",
            "engine",
            f"unknown rollout engine {r.engine!r}",
            f"use one of: {', '.join(KNOWN_ENGINES)}",
        )
    else:
        try:
            kind = load_engine(r.engine)
        except BackendUnavailableError as exc:
            add(RolloutConfig, "rollout", "engine", str(exc))
        else:
            if r.engine_options is not None and not isinstance(r.engine_options, kind.options_type):
                problems.append(
                    ConfigProblem(
                        "rollout.engine_options",
                        f"engine {r.engine!r} takes {kind.options_type.__name__}, "
                        f"got {type(r.engine_options).__name__}",
                    )
                )
            else:
                runs_servers = kind.runs_servers(kind.options(r.engine_options))

    for name in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine"):
        if getattr(k, name) < 1:
            add(ClusterConfig, "cluster", name, f"must be >= 1, got {getattr(k, name)}")
    for name in ("critic_num_nodes", "critic_num_gpus_per_node", "rollout_num_gpus"):
        value = getattr(k, name)
        if value is not None and value < 1:
            add(ClusterConfig, "cluster", name, f"must be >= 1, got {value}")
    if _problems_in(problems, "cluster."):
        return problems
    if not runs_servers:
        why = f"the {r.engine!r} engine starts no servers (with these settings)"
        if k.rollout_num_gpus is not None:
            add(ClusterConfig, "cluster", "rollout_num_gpus", why, "drop the flag")
        if k.colocate:
            add(ClusterConfig, "cluster", "colocate", why, "drop the flag")
        return problems
    if k.rollout_gpus % k.rollout_num_gpus_per_engine:
        add(
            ClusterConfig,
            "cluster",
            "rollout_num_gpus",
            f"{k.rollout_gpus} rollout GPUs do not split into engines of "
            f"--rollout-num-gpus-per-engine {k.rollout_num_gpus_per_engine}",
            "make it a multiple",
        )
    if k.colocate and k.rollout_gpus > k.actor_ranks:
        add(
            ClusterConfig,
            "cluster",
            "rollout_num_gpus",
            f"--colocate puts the rollout servers on the actor's {k.actor_ranks} GPUs, "
            f"but {k.rollout_gpus} are asked for",
            "lower --rollout-num-gpus or drop --colocate",
        )
    return problems


# --------------------------------------------------------------------------------------------
# Converter


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    conv.register_structure_hook(Path, lambda v, _: _structure_path(v))
    conv.register_structure_hook(int, lambda v, _: _structure_int(v))
    conv.register_structure_hook(float, lambda v, _: _structure_float(v))
    conv.register_structure_hook(bool, lambda v, _: _structure_bool(v))
    conv.register_structure_hook_func(lambda t: t is object, _structure_engine_options)
    return conv


class _NotFinite(ValueError):
    """A NaN or infinite float value (reported without the "invalid value" prefix)."""


def _structure_engine_options(value: object, _: object) -> object:
    raise TypeError(
        "engine settings go in the engine's own section ([sglang] for --rollout-engine sglang)"
    )


# Strict scalars: cattrs' defaults call int()/bool() and would turn 3.7 into 3 and "no" into True.
def _structure_path(value: object) -> Path:
    if isinstance(value, (str, Path)):
        return Path(value)
    raise TypeError(f"expected a path string, got {type(value).__name__}")


def _structure_int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise TypeError(f"expected an integer, got {value!r}")


def _structure_float(value: object) -> float:
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise TypeError(f"expected a number, got {value!r}")
    if not math.isfinite(number):
        # Refused here, so the field itself is named and no invariant sees it.
        raise _NotFinite(f"must be a finite number, got {value}")
    return number


def _structure_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise TypeError(f"expected true or false, got {value!r}")


converter = _make_converter()
"""The one converter for configs: unknown keys are errors, all errors are collected."""


def _did_you_mean(key: str, cls: type[Any]) -> str:
    names = [f.name for f in attrs.fields(cls)]
    close = difflib.get_close_matches(key, names, n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(names)}"


def _problems_from(exc: BaseException, path: str, cls: type[Any] | None) -> list[ConfigProblem]:
    if isinstance(exc, ForbiddenExtraKeysError):
        return [
            ConfigProblem(
                path=f"{path}.{key}" if path else key,
                message="unknown key",
                hint=_did_you_mean(key, exc.cl),
            )
            for key in sorted(exc.extra_fields)
        ]
    if isinstance(exc, ClassValidationError):
        out: list[ConfigProblem] = []
        noted, bare = exc.group_exceptions()
        for sub, note in noted:
            sub_path = f"{path}.{note.name}" if path else note.name
            out += _problems_from(sub, sub_path, exc.cl)
        for sub in bare:
            out += _problems_from(sub, path, exc.cl)
        return out
    if isinstance(exc, IterableValidationError):
        out = []
        inoted, ibare = exc.group_exceptions()
        for sub, inote in inoted:
            out += _problems_from(sub, f"{path}[{inote.index}]", None)
        for sub in ibare:
            out += _problems_from(sub, path, None)
        return out
    if isinstance(exc, ConfigError):
        return list(exc.problems)
    if isinstance(exc, _NotFinite):
        return [ConfigProblem(path=with_flag(path) or "<root>", message=str(exc))]
    del cls
    return [ConfigProblem(path=with_flag(path) or "<root>", message=f"invalid value: {exc}")]


def with_flag(path: str) -> str:
    """``rollout.num_rollout`` -> ``rollout.num_rollout (--num-rollout)`` when the field has a
    flag."""
    owner: type[Any] = RunConfig
    meta: Any = {}
    for part in path.split("."):
        fields = attrs.fields_dict(owner) if attrs.has(owner) else {}
        if part not in fields:
            return path
        meta = fields[part].metadata
        field_type = fields[part].type
        owner = field_type if isinstance(field_type, type) else object
    return f"{path} ({meta['flag']})" if "flag" in meta else path


def structure_config(data: dict[str, Any], source: str = "") -> RunConfig:
    """Build a :class:`RunConfig` from nested plain data (a parsed TOML file, flags merged in).

    Raises :class:`ConfigError` listing every problem: unknown keys (with a suggestion), values of
    the wrong type, and every broken invariant.
    """
    try:
        return converter.structure(data, RunConfig)
    except ConfigError as exc:
        raise ConfigError(exc.problems, source) from None
    except (ClassValidationError, ForbiddenExtraKeysError) as exc:
        raise ConfigError(_problems_from(exc, "", RunConfig), source) from exc
