"""What a backend is asked to build: model specs, the LR schedule, loss and optimizer settings.

These are the values a :class:`~rlcore.loop.plan.TrainPlan` or :class:`~rlcore.loop.plan.EvalPlan`
holds. Each one's invariants hold by construction: an :class:`LRSchedule` with zero decay steps
cannot exist, so Megatron's scheduler asserts cannot be reached from a plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal

import attrs

__all__ = [
    "AdvantageEstimator",
    "AdvantageSpec",
    "DecayStyle",
    "EnvRewardMode",
    "EvalSpec",
    "GROUPED_ESTIMATORS",
    "ISCorrection",
    "ISLevel",
    "ISMode",
    "LoadSpec",
    "KLType",
    "LossAggMode",
    "LRSchedule",
    "LossSpec",
    "ModelSpec",
    "OPDSpec",
    "OptimizerSpec",
    "ParallelSpec",
    "Precision",
    "RatioLevel",
    "RewardName",
    "Role",
    "ServedTeacher",
    "TrainSpec",
    "batch_split_problem",
    "dual_clip_problem",
    "parallel_split_problem",
    "schedule_length_problem",
]

Role = Literal["actor", "critic", "reference", "teacher"]
DecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root"]
AdvantageEstimator = Literal[
    "grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"
]
GROUPED_ESTIMATORS: Final[frozenset[AdvantageEstimator]] = frozenset(
    {"grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"}
)
"""The estimators that compare the samples of one prompt (``n_samples_per_prompt`` of them,
consecutive): with a group of one there is nothing to compare."""
KLType = Literal["k1", "k2", "k3", "low_var_kl"]
Precision = Literal["float32", "bfloat16"]
"""The dtype a model's weights and activations are held in. ``bfloat16`` is mixed precision when
the model trains: the optimizer keeps fp32 main weights and state and reduces gradients in fp32."""
LossAggMode = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-budget"]
"""How per-token losses become one number over the global batch: the mean over sequences of each
sequence's token mean (GRPO; verl's ``seq-mean-token-mean``), the mean over every token (DAPO;
verl's ``token-mean``, slime's ``--calculate-per-token-loss``), or the mean over sequences of each
sequence's token *sum* divided by a constant, the generation budget (Dr. GRPO's normaliser, TRL's
``loss_type="dr_grpo"``). The last is not verl's ``seq-mean-token-sum-norm``: verl sums over a
micro-batch's sequences without dividing by their count, so its number depends on the micro-batch
and data-parallel sizes (:mod:`rlcore.algorithms.losses`)."""
RatioLevel = Literal["token", "sequence"]
"""The PPO ratio per token, or one per sequence (GSPO: the geometric mean of the token ratios)."""
ISMode = Literal["clip", "mask"]
ISLevel = Literal["token", "geometric"]
RewardName = Literal["exact_match", "math"]
"""The built-in rule rewards (``--rm-type``; :data:`rlcore.rollout.rewards.BUILTIN_REWARDS`)."""
EnvRewardMode = Literal["ignore", "replace", "add"]
"""How an environment's reward meets the reward function's (``--env-reward``)."""


# The rules each spec's constructor enforces, as functions: :func:`rlcore.config.check` applies the
# same ones to a config's fields, so a rule is written once and a config that passes its check
# always plans into valid specs.


def parallel_split_problem(tensor: int, world_size: int, pipeline: int = 1) -> str | None:
    """Why ``world_size`` ranks cannot be split into groups of ``tensor`` tensor-parallel ranks
    times ``pipeline`` pipeline stages (all >= 1), or ``None``."""
    if world_size % (tensor * pipeline):
        split = f"tensor parallel {tensor}" + (
            f" x pipeline parallel {pipeline}" if pipeline > 1 else ""
        )
        return f"{split} does not divide the {world_size} ranks"
    return None


def expert_split_problem(expert: int, tensor: int, world_size: int) -> str | None:
    """Why ``world_size`` ranks cannot hold a mixture-of-experts model's experts shared out over
    ``expert`` groups of ``tensor`` tensor-parallel ranks (each expert is split over the TP ranks,
    as Megatron does by default), or ``None``. All sizes >= 1."""
    if world_size % (expert * tensor):
        return (
            f"expert parallel {expert} x tensor parallel {tensor} does not divide the "
            f"{world_size} ranks (each expert is split over the tensor parallel ranks)"
        )
    return None


def batch_split_problem(
    global_batch_size: int, micro_batch_size: int, data_parallel_size: int
) -> str | None:
    """Why a global batch cannot be cut into whole micro-batches on every data-parallel rank
    (all sizes >= 1), or ``None``. Each rank trains on ``global_batch_size / data_parallel_size``
    samples in micro-batches of ``micro_batch_size``."""
    if global_batch_size % (micro_batch_size * data_parallel_size):
        return (
            f"global batch {global_batch_size} is not a multiple of micro_batch_size x "
            f"data-parallel ranks = {micro_batch_size} x {data_parallel_size}"
        )
    return None


def dual_clip_problem(eps_clip_c: float | None) -> str | None:
    """Why ``eps_clip_c`` cannot be dual-clip PPO's bound, or ``None`` (``None``: no dual clip).
    It must be > 1, as slime and verl assert: a negative advantage's loss ``-r A`` is bounded at
    ``c |A|``, which then acts where the ratio ``r`` exceeds ``c``, above the trust region."""
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        return (
            f"must be > 1 (the ratio above which a negative advantage's loss stops growing), "
            f"got {eps_clip_c}"
        )
    return None


def schedule_length_problem(
    warmup_steps: int, decay_steps: int
) -> tuple[Literal["warmup_steps", "decay_steps"], str] | None:
    """The field and reason when Megatron's ``OptimizerParamScheduler`` would assert on these
    step counts (``decay_steps < 1``, or a warmup not shorter than the decay), or ``None``."""
    if decay_steps < 1:
        return "decay_steps", f"must be >= 1, got {decay_steps} (Megatron's scheduler asserts)"
    if not 0 <= warmup_steps < decay_steps:
        return "warmup_steps", f"must be in [0, decay_steps={decay_steps}), got {warmup_steps}"
    return None


@attrs.frozen
class ParallelSpec:
    """How one model is split over ``world_size`` ranks, in the dimensions TorchTitan's
    ``ParallelDims`` names: ``tensor`` parallel (each layer's weights split over ranks),
    ``pipeline`` parallel (the layers cut into stages), ``expert`` parallel (a mixture-of-experts
    model's experts shared out over groups of tensor-parallel ranks, folded into the same ranks
    as Megatron does), and data parallel over what is left (:attr:`data`). A backend refuses a
    dimension it does not implement before anything starts
    (:attr:`rlcore.backends.BackendKind.parallel_problem`)."""

    tensor: int = 1
    world_size: int = 1
    expert: int = 1
    pipeline: int = 1

    def __attrs_post_init__(self) -> None:
        if min(self.tensor, self.world_size, self.expert, self.pipeline) < 1:
            raise ValueError("parallel sizes must be >= 1")
        problem = parallel_split_problem(
            self.tensor, self.world_size, self.pipeline
        ) or expert_split_problem(self.expert, self.tensor, self.world_size)
        if problem:
            raise ValueError(f"ParallelSpec: {problem}")

    @property
    def data(self) -> int:
        """Data-parallel ranks: each holds a whole copy of the model (its tensor and pipeline
        shards) and trains on its share of every global batch."""
        return self.world_size // (self.tensor * self.pipeline)


@attrs.frozen
class ModelSpec:
    """Which model a stack holds and where its first weights come from.

    ``hf_checkpoint`` is a Hugging Face folder (``config.json`` + safetensors); a backend builds the
    architecture from it and loads its weights. ``role`` says which head the model has: a policy
    (``actor``, ``reference``) gives token log-probs, a ``critic`` a scalar value per token.
    ``precision`` is the dtype of the model's weights and activations (see :data:`Precision`).
    """

    role: Role
    hf_checkpoint: Path | None
    seed: int = 1234
    parallel: ParallelSpec = ParallelSpec()
    moe_aux_loss_coeff: float = 0.0
    """Weight of a mixture-of-experts router's load-balancing loss in training (0 = none)."""
    precision: Precision = "float32"
    temperature: float = 1.0
    """The rollout engine's sampling temperature (``--rollout-temperature``): a policy's
    log-probs and entropies are of ``softmax(logits / temperature)``, the distribution that
    sampled (:func:`rlcore.logits.tempered`; 0, greedy, means 1). A critic ignores it."""
    log_probs_max_tokens_per_gpu: int | None = None
    """The forward-only passes' token budget (log-probs, values, a teacher's scores): each
    micro-batch holds at most this many tokens padded to its longest sequence
    (:mod:`rlcore.algorithms.token_budget`); ``None``: a fixed number of sequences."""

    def __attrs_post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"ModelSpec.temperature must be >= 0, got {self.temperature}")
        budget = self.log_probs_max_tokens_per_gpu
        if budget is not None and budget < 1:
            raise ValueError(f"ModelSpec.log_probs_max_tokens_per_gpu must be >= 1, got {budget}")


@attrs.frozen
class LRSchedule:
    """A learning-rate schedule in optimizer steps, valid by construction.

    Refuses ``decay_steps < 1`` and ``warmup_steps >= decay_steps``: the two conditions under which
    Megatron's ``OptimizerParamScheduler`` asserts (slime's ``--num-rollout 0`` crash).
    """

    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: DecayStyle = "constant"

    def __attrs_post_init__(self) -> None:
        length = schedule_length_problem(self.warmup_steps, self.decay_steps)
        if length:
            field, problem = length
            raise ValueError(f"LRSchedule.{field} {problem}")
        if not (self.lr > 0 and 0 <= self.min_lr <= self.lr):
            raise ValueError(
                f"LRSchedule needs lr > 0 and 0 <= min_lr <= lr, got {self.lr}, {self.min_lr}"
            )

    def lr_at(self, step: int) -> float:
        """The learning rate before optimizer step ``step`` (0-based), as Megatron computes it."""
        import math

        if self.warmup_steps > 0 and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.decay_style == "constant":
            return self.lr
        if step > self.decay_steps:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            warmup = max(self.warmup_steps, 1)
            return max(self.min_lr, self.lr * math.sqrt(warmup) / math.sqrt(max(step, 1)))
        ratio = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.lr - self.min_lr)


@attrs.frozen
class OptimizerSpec:
    """AdamW settings. ``clip_grad`` is the global L2 norm limit (0 disables clipping).

    ``distributed`` shards the optimizer state (and, in mixed precision, the fp32 main weights)
    over the data-parallel ranks instead of replicating it (Megatron's distributed optimizer,
    ZeRO stage 1).
    """

    schedule: LRSchedule
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    distributed: bool = False


@attrs.frozen
class ISCorrection:
    """Importance-sampling correction of the gap between the rollout engine's log-probs and the
    trainer's (``--use-tis``), valid by construction.

    With ``r_t = exp(train_t - rollout_t)`` (the trainer's log-prob of token ``t`` at the start of
    the rollout's training over the engine's), each token's policy loss is multiplied by a detached
    weight ``w``:

    - ``level="token"``: ``w_t`` from ``r_t``; ``level="geometric"``: one weight per sequence from
      ``exp(mean_t log r_t)``, the geometric mean of its token ratios.
    - ``mode="clip"`` (TIS): ``w = clamp(r, low, high)``; ``mode="mask"`` (IcePop / MIS):
      ``w = r`` inside ``[low, high]`` and 0 outside.
    - ``veto_threshold``: a sequence with any ``r_t`` below it gets weight 0 on every token.
    - ``custom_path``: ``module:function`` computing the weights instead (see
      :mod:`rlcore.algorithms.correction`).

    ``low <= 1 <= high``, so a token on which the engine and the trainer agree keeps weight 1.
    """

    mode: ISMode = "clip"
    level: ISLevel = "token"
    low: float = 0.0
    high: float = 2.0
    veto_threshold: float | None = None
    custom_path: str | None = None

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.low <= 1.0 <= self.high:
            raise ValueError(
                f"ISCorrection needs 0 <= low <= 1 <= high, got low={self.low}, high={self.high}"
            )
        if self.veto_threshold is not None and not 0.0 < self.veto_threshold < 1.0:
            raise ValueError(
                f"ISCorrection.veto_threshold must be in (0, 1), got {self.veto_threshold}"
            )


@attrs.frozen
class LossSpec:
    """The loss a training stack minimises. For the actor: clipped policy loss (PPO/GRPO, with a
    sequence-level ratio for GSPO), optional importance-sampling correction, KL loss against the
    reference and entropy bonus. For the critic: clipped value loss. Both are aggregated over
    tokens and sequences as ``agg_mode`` says; ``agg_constant`` is Dr. GRPO's normaliser (the
    generation budget, ``--rollout-max-response-len``) for ``seq-mean-token-sum-budget``.

    ``eps_clip_c``: dual-clip PPO's bound (None: off): a token with a negative advantage loses
    at most ``eps_clip_c * |A|`` (:func:`rlcore.algorithms.losses.policy_loss`).

    ``use_rollout_logprobs``: the PPO ratio's old log-probs are the engine's (the loop puts them
    in the batch), so the mismatch metric compares this pass's log-probs with them instead.
    """

    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    eps_clip_c: float | None = None
    value_clip: float = 0.2
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: KLType = "low_var_kl"
    agg_mode: LossAggMode = "seq-mean-token-mean"
    agg_constant: int = 1
    ratio_level: RatioLevel = "token"
    correction: ISCorrection | None = None
    use_rollout_logprobs: bool = False

    def __attrs_post_init__(self) -> None:
        if self.agg_constant < 1:
            raise ValueError(f"LossSpec.agg_constant must be >= 1, got {self.agg_constant}")
        problem = dual_clip_problem(self.eps_clip_c)
        if problem:
            raise ValueError(f"LossSpec.eps_clip_c {problem}")


@attrs.frozen
class AdvantageSpec:
    """How rewards become per-token advantages (and, with a critic, returns).

    ``group_size`` is ``n_samples_per_prompt``: consecutive samples of one prompt form a group
    (GRPO, REINFORCE++-baseline). ``kl_coef`` > 0 subtracts ``kl_coef * KL_t`` (estimator
    ``kl_type``, against the reference model) from the per-token reward. ``normalize_std = False``
    is Dr. GRPO (no division by the group's std). ``whiten`` rescales the final advantages to mean
    0 and unbiased (``n - 1``) variance 1 over the rollout's model tokens, those of the loss mask
    (a multi-turn episode's environment tokens and padding are left out and read 0): slime's
    ``--normalize-advantages``, whose whitening verl and OpenRLHF apply to PPO's advantages;
    critic returns are taken before it.
    """

    estimator: AdvantageEstimator
    group_size: int
    gamma: float = 1.0
    lambd: float = 1.0
    kl_coef: float = 0.0
    kl_type: KLType = "k1"
    normalize_std: bool = True
    whiten: bool = False


@attrs.frozen
class EvalSpec:
    """An eval-only model: weights and a forward pass, nothing to train."""

    model: ModelSpec


@attrs.frozen
class ServedTeacher:
    """A distillation teacher served by an inference server at ``url`` (``--opd-type sglang``):
    it scores the student's samples during rollout, over HTTP, and holds nothing of the run: no
    stack is built for it, so it has no optimizer either."""

    url: str


@attrs.frozen
class OPDSpec:
    """On-policy distillation: ``teacher`` scores the student's sampled tokens, and each token's
    advantage loses ``kl_coef`` times the student's log-prob minus the teacher's, after the
    estimator and before any whitening, as in slime (:mod:`rlcore.algorithms.distill`). The
    teacher is an :class:`EvalSpec`, built as an eval stack, which has no optimizer, and scores
    at train time (``--opd-type backend``); or a :class:`ServedTeacher`, a server that scores
    each rollout as it is made (``--opd-type sglang``).

    ``teacher_load``: a checkpoint folder (``rollout_NNNNNN``) whose ``actor`` holds the teacher's
    weights, loaded into the eval stack once it is built (weights only); the spec's model folder
    then gives only the architecture. ``only`` (``--opd-only``): pure distillation, no reward, each
    token's advantage ``-kl_coef * (student - teacher)``
    (:func:`rlcore.algorithms.distill.distillation_advantages`)."""

    teacher: EvalSpec | ServedTeacher
    kl_coef: float = 1.0
    teacher_load: Path | None = None
    only: bool = False


@attrs.frozen
class LoadSpec:
    """What a training stack's ``load`` restores from a checkpoint besides the model's weights
    (the resume flags ``--no-load-optim``, ``--override-opt-param-scheduler``, ``--finetune``).

    ``optimizer``: the optimizer's state (Adam's moments; in mixed precision, the fp32 main
    weights); without it the optimizer starts afresh. ``scheduler``: ``"saved"`` restores the
    learning-rate schedule as the checkpoint has it; ``"flags"`` keeps its step count but takes
    the schedule's values (learning rates, warmup, decay, style) and the optimizer's settings
    (weight decay, betas) from this spec, over what the checkpoint holds (Megatron's
    ``--override-opt_param-scheduler``); ``"fresh"`` starts the schedule at step 0.
    """

    optimizer: bool = True
    scheduler: Literal["saved", "flags", "fresh"] = "saved"


@attrs.frozen
class TrainSpec:
    """A model to train: the model, its optimizer and schedule, its loss and batch split.

    One ``train_step`` receives a rollout's samples and takes ``steps_per_rollout`` optimizer steps
    of ``global_batch_size`` samples each, in micro-batches of ``micro_batch_size`` per rank.

    Valid by construction: every size is >= 1 and the global batch splits into whole micro-batches
    on every data-parallel rank (:func:`batch_split_problem`), so no backend checks it again.
    """

    model: ModelSpec
    optimizer: OptimizerSpec
    loss: LossSpec
    global_batch_size: int
    micro_batch_size: int = 1
    steps_per_rollout: int = 1
    load: LoadSpec = LoadSpec()
    """What ``load`` restores from a checkpoint (a resume; see :class:`LoadSpec`)."""
    max_tokens_per_gpu: int | None = None
    """The train step's token budget: each rank's micro-batches hold at most this many tokens
    padded to their longest sequence, instead of ``micro_batch_size`` sequences
    (:func:`rlcore.algorithms.train_step.step_micro_batches`); ``None``: by sequence count."""

    def __attrs_post_init__(self) -> None:
        for name in ("global_batch_size", "micro_batch_size", "steps_per_rollout"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"TrainSpec.{name} must be >= 1, got {value}")
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise ValueError(
                f"TrainSpec.max_tokens_per_gpu must be >= 1, got {self.max_tokens_per_gpu}"
            )
        problem = batch_split_problem(
            self.global_batch_size, self.micro_batch_size, self.model.parallel.data
        )
        if problem:
            raise ValueError(f"TrainSpec: {problem}")
