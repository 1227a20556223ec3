"""The ``[algorithm]`` section: advantage estimation, the policy loss, KL, importance-sampling
correction, the supervised warm start; and the invariants a training run's algorithm must keep
(:func:`algorithm_problems`).
"""

from __future__ import annotations

import attrs

from rlcore.config.fields import option, problem
from rlcore.config.rollout import RolloutConfig
from rlcore.errors import ConfigProblem
from rlcore.specs import (
    GROUPED_ESTIMATORS,
    AdvantageEstimator,
    ISLevel,
    ISMode,
    KLType,
    LossAggMode,
    dual_clip_problem,
)

__all__ = ["AlgorithmConfig", "algorithm_problems", "correction_problems"]


@attrs.frozen
class AlgorithmConfig:
    """Advantage estimation, policy loss, KL."""

    advantage_estimator: AdvantageEstimator = option(
        "grpo",
        "--advantage-estimator",
        "grpo, gspo (sequence-level ratio), rloo (leave-one-out baseline), reinforce_plus_plus, "
        "reinforce_plus_plus_baseline or ppo",
    )
    use_critic: bool = option(
        False, "--use-critic", "train a critic (implied by --advantage-estimator ppo)"
    )
    gamma: float = option(1.0, "--gamma", "discount factor (PPO/GAE, REINFORCE++)")
    lambd: float = option(1.0, "--lambd", "GAE lambda")
    normalize_std: bool = option(
        True,
        "--disable-grpo-std-normalization",
        "Dr. GRPO: do not divide by the group std",
        invert=True,
    )
    normalize_advantages: bool = option(
        False,
        "--normalize-advantages",
        "whiten advantages over the rollout's model (loss-mask) tokens: mean 0, unbiased "
        "variance 1 (usual for PPO)",
    )
    kl_coef: float = option(0.0, "--kl-coef", "KL penalty on the reward (needs a reference model)")
    kl_penalty_type: KLType = option("k1", "--kl-penalty-type", "KL estimator for --kl-coef")
    use_kl_loss: bool = option(False, "--use-kl-loss", "add a KL loss against the reference model")
    kl_loss_coef: float = option(0.0, "--kl-loss-coef", "weight of the KL loss")
    kl_loss_type: KLType = option("low_var_kl", "--kl-loss-type", "k1, k2, k3 or low_var_kl")
    eps_clip: float = option(0.2, "--eps-clip", "PPO clip range below 1")
    eps_clip_high: float | None = option(
        None, "--eps-clip-high", "PPO clip range above 1 (default: --eps-clip)"
    )
    eps_clip_c: float | None = option(
        None,
        "--eps-clip-c",
        "dual-clip PPO (> 1): a token with a negative advantage A loses at most c * |A| "
        "(default: off)",
    )
    value_clip: float = option(0.2, "--value-clip", "critic value clip range")
    entropy_coef: float = option(0.0, "--entropy-coef", "entropy bonus weight")
    loss_agg_mode: LossAggMode = option(
        "seq-mean-token-mean",
        "--loss-agg-mode",
        "seq-mean-token-mean (GRPO), token-mean (DAPO) or seq-mean-token-sum-budget (Dr. GRPO: "
        "each sequence's token sum over --rollout-max-response-len, mean over sequences; verl's "
        "seq-mean-token-sum-norm is another number)",
    )
    calculate_per_token_loss: bool = option(
        False, "--calculate-per-token-loss", "slime's name for --loss-agg-mode token-mean"
    )
    use_rollout_logprobs: bool = option(
        False,
        "--use-rollout-logprobs",
        "PPO's old log-probs are the rollout engine's (no trainer recompute)",
    )
    use_tis: bool = option(
        False,
        "--use-tis",
        "reweight each token's policy loss by the trainer/engine probability ratio (TIS)",
    )
    tis_clip: float = option(2.0, "--tis-clip", "upper bound of the importance weight")
    tis_clip_low: float = option(0.0, "--tis-clip-low", "lower bound of the importance weight")
    tis_mode: ISMode = option(
        "clip",
        "--tis-mode",
        "clip (TIS: clamp to the bounds) or mask (IcePop/MIS: weight 0 outside them)",
    )
    tis_level: ISLevel = option(
        "token",
        "--tis-level",
        "token, or geometric: one weight per sequence from the geometric mean of its ratios",
    )
    tis_veto_threshold: float | None = option(
        None,
        "--tis-veto-threshold",
        "weight 0 for every token of a sequence with any token ratio below this",
    )
    custom_tis_function_path: str | None = option(
        None,
        "--custom-tis-function-path",
        "module:function computing the importance weights instead",
    )
    sft_warmup_rollouts: int = option(
        0,
        "--sft-warmup-rollouts",
        "first N rollouts train on the labels (supervised warm start), not on samples "
        "(all of them: a warm-start-only run)",
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


def algorithm_problems(a: AlgorithmConfig, r: RolloutConfig) -> list[ConfigProblem]:
    """What a training run's algorithm needs: the correction flags agree, a grouped estimator
    has groups to compare (unless every rollout is warm start), the warm start fits in the run,
    coefficients in range."""
    problems = correction_problems(a, r.max_staleness)

    def add(name: str, message: str, hint: str = "", reads: tuple[str, ...] = ()) -> None:
        problems.append(problem(AlgorithmConfig, "algorithm", name, message, hint, reads=reads))

    warm_start_only = r.num_rollout is not None and a.sft_warmup_rollouts >= r.num_rollout > 0
    if (
        a.advantage_estimator in GROUPED_ESTIMATORS
        and r.n_samples_per_prompt < 2
        and not warm_start_only
    ):
        problems.append(
            problem(
                RolloutConfig,
                "rollout",
                "n_samples_per_prompt",
                f"{a.advantage_estimator} compares samples within a prompt's group, so it needs "
                ">= 2",
                "raise --n-samples-per-prompt",
                reads=("algorithm.advantage_estimator",),
            )
        )
    # (with --num-epoch, num_rollout is None: known once the prompt file is read)
    if a.sft_warmup_rollouts < 0 or a.sft_warmup_rollouts > (r.num_rollout or 0):
        add(
            "sft_warmup_rollouts",
            f"must be in [0, num_rollout] (= [0, {r.num_rollout}]), got {a.sft_warmup_rollouts}",
            "a run of warm start only sets both to the same number; RL can follow from its "
            "checkpoint with --load DIR --finetune",
            reads=("rollout.num_rollout",),
        )
    if a.kl_coef < 0 or a.kl_loss_coef < 0:
        add("kl_coef" if a.kl_coef < 0 else "kl_loss_coef", "must be >= 0")
    if a.eps_clip < 0 or (a.eps_clip_high is not None and a.eps_clip_high < 0):
        add("eps_clip", "clip ranges must be >= 0")
    dual = dual_clip_problem(a.eps_clip_c)
    if dual:
        add(
            "eps_clip_c", dual, "slime's and verl's usual value is 3; leave it out for no dual clip"
        )
    if not 0 <= a.gamma <= 1 or not 0 <= a.lambd <= 1:
        add("gamma", f"gamma and lambd must be in [0, 1], got {a.gamma}, {a.lambd}")
    return problems


def correction_problems(a: AlgorithmConfig, max_staleness: int = 0) -> list[ConfigProblem]:
    """The mismatch-correction and loss-aggregation flags (``--max-staleness`` > 0 implies
    ``--use-tis``)."""
    problems: list[ConfigProblem] = []
    corrects = a.use_tis or max_staleness > 0

    def add(name: str, message: str, hint: str = "") -> None:
        problems.append(problem(AlgorithmConfig, "algorithm", name, message, hint))

    if a.use_tis and a.use_rollout_logprobs:
        add(
            "use_tis",
            "cannot be combined with --use-rollout-logprobs: with the engine's log-probs as the "
            "old ones there is no trainer/engine ratio left to correct",
            "choose one (as slime requires)",
        )
    elif max_staleness > 0 and a.use_rollout_logprobs:
        add(
            "use_rollout_logprobs",
            f"cannot be combined with --max-staleness {max_staleness}: an off-policy update "
            "takes the trainer's recomputed log-probs as PPO's old ones and corrects them "
            "towards the engine's (the decoupled objective); with the engine's as the old ones "
            "nothing is corrected",
            "drop --use-rollout-logprobs",
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
    if not corrects:
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
