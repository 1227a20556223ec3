"""The planner: a :class:`RunConfig` becomes exactly one of :class:`TrainPlan`, :class:`EvalPlan`
or :class:`RolloutOnlyPlan`.

An ``EvalPlan`` has no critic, reference model, optimizer or schedule *fields at all*, so code
holding one cannot reach them; neither has a ``RolloutOnlyPlan`` (``--debug-rollout-only``), which
builds no training stack. A ``TrainPlan`` has a critic spec only when a critic is trained and a
reference spec only when KL needs one, and its :class:`~rlcore.specs.LRSchedule` is valid by
construction. Callers ``match`` on the result; mypy checks the match is exhaustive.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rlcore.checkpoint_files import find_checkpoint_of, recorded_model_folder
from rlcore.config import RunConfig, with_flag
from rlcore.config.convert import settings_data
from rlcore.errors import CheckpointError, ConfigError, ConfigProblem, PlanError
from rlcore.protocols.rollout import DEFAULT_MAX_ROUNDS
from rlcore.samples import SamplingParams
from rlcore.specs import (
    AdvantageSpec,
    EvalSpec,
    ISCorrection,
    LoadSpec,
    LossSpec,
    LRSchedule,
    ModelSpec,
    OPDSpec,
    OptimizerSpec,
    ParallelSpec,
    Role,
    ServedTeacher,
    TrainSpec,
)

__all__ = [
    "EvalPlan",
    "Plan",
    "RolloutOnlyPlan",
    "RolloutSpec",
    "TrainPlan",
    "plan",
    "resolve_num_rollout",
]


@attrs.frozen
class RolloutSpec:
    """How a plan's rollouts are produced: dynamic sampling, the rollout function, debug files.

    ``over_sampling_batch_size`` (prompts per generation round) is ``None`` for "the rollout batch
    size". ``filter_path`` and ``function_path`` are ``module:function`` paths (``None``: no filter,
    :func:`~rlcore.rollout.default_rollout`). ``keep_surplus`` carries groups that passed beyond
    the batch size to the next rollout (and into checkpoints) instead of dropping them.
    ``save_debug_data`` is
    ``--save-debug-rollout-data``'s path template.
    """

    over_sampling_batch_size: int | None = None
    filter_path: str | None = None
    keep_surplus: bool = False
    max_rounds: int = DEFAULT_MAX_ROUNDS
    function_path: str | None = None
    save_debug_data: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"RolloutSpec.max_rounds must be >= 1, got {self.max_rounds}")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < 1:
            raise ValueError(
                f"RolloutSpec.over_sampling_batch_size must be >= 1, "
                f"got {self.over_sampling_batch_size}"
            )


@attrs.frozen
class EvalPlan:
    """Evaluate one policy and stop. ``skipped`` says what the config asked for that an eval-only
    run does not build, and why (one line each, for the log)."""

    actor: EvalSpec
    eval_params: SamplingParams
    n_samples_per_eval_prompt: int
    load: Path | None
    skipped: tuple[str, ...] = ()
    random_weights: bool = False
    """Opt in to evaluating the backend's freshly initialised weights when there is neither
    ``load`` nor a model folder (``attrs.evolve(plan, random_weights=True)``); otherwise that run
    is refused as a mistake."""


@attrs.frozen
class TrainPlan:
    """Train for rollout ids ``start_rollout_id .. num_rollout - 1``.

    Rollouts below ``sft_warmup_rollouts`` are a supervised warm start: the actor trains on each
    prompt's reference completion (advantage 1, ratio 1: exactly the SFT gradient), nothing is
    generated, the critic does not train.

    ``start_rollout_id`` is ``None`` when it comes from the checkpoint being loaded (its id + 1).

    ``rollout`` says how each rollout's groups are produced (dynamic sampling, the rollout
    function, debug files). ``replay_rollout_data`` (``--load-debug-rollout-data``) replaces
    generation by the rollouts saved under that path template: no engine is needed and nothing is
    evaluated.
    """

    actor: TrainSpec
    critic: TrainSpec | None
    reference: EvalSpec | None
    advantage: AdvantageSpec
    rollout_params: SamplingParams
    eval_params: SamplingParams
    num_rollout: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    n_samples_per_eval_prompt: int
    eval_interval: int | None
    eval_before_train: bool
    save_dir: Path | None
    save_interval: int | None
    load: Path | None
    start_rollout_id: int | None
    sft_warmup_rollouts: int = 0
    rollout: RolloutSpec = RolloutSpec()
    replay_rollout_data: str | None = None
    finetune: bool = False
    """``--finetune``: ``load``'s weights only, the run starting at rollout 0 (or
    ``start_rollout_id``) with a fresh optimizer, schedule and prompt stream."""
    max_staleness: int = 0
    """How many policy versions a trained sample may lag behind the trainer
    (``--max-staleness``): 0 is the synchronous schedule (:mod:`rlcore.loop.training`), more is
    :mod:`rlcore.loop.overlap`'s."""
    partial_rollout: bool = False
    """New weights interrupt in-flight generation (``--partial-rollout``, with ``max_staleness``
    > 1)."""
    save_retain: int | None = None
    """Keep only the newest ``save_retain`` checkpoints in ``save_dir`` (``--save-retain``)."""
    save_hf: str | None = None
    """Where the actor is also written as a Hugging Face folder (``--save-hf``): a folder, whose
    exports are ``rollout_NNNNNN`` inside it, or a path template with ``{rollout_id}``
    (:func:`rlcore.loop.hf_export.hf_folder`)."""
    save_hf_interval: int | None = None
    """Export every ``save_hf_interval`` rollouts (and always after the last one)."""
    opd: OPDSpec | None = None
    """On-policy distillation (``--use-opd``): the teacher (an eval stack built beside the actor,
    or a server) and the weight of its reverse KL in the advantage."""
    settings: Mapping[str, Any] = attrs.field(factory=dict, hash=False)
    """The run's configuration as plain data (:func:`~rlcore.config.convert.settings_data`),
    recorded in every checkpoint: an eval-only run of the checkpoint takes its sampling and data
    settings from there."""


@attrs.frozen
class RolloutOnlyPlan:
    """Generate (and save) rollouts ``start_rollout_id .. num_rollout - 1`` without training
    (``--debug-rollout-only``): no training stack, optimizer, critic or reference model exists.

    The engine samples with the weights it was started with; with ``load`` the actor is built as
    an *eval* stack only to read the checkpoint and push its weights, and the prompt stream and
    carried groups continue from the checkpoint (with ``finetune``: the weights only, from rollout
    ``start_rollout_id`` or 0 with a fresh prompt stream). ``skipped`` says what the config asked
    for that this run does not do (one line each, for the log).
    """

    actor: EvalSpec
    rollout: RolloutSpec
    rollout_params: SamplingParams
    num_rollout: int
    rollout_batch_size: int
    n_samples_per_prompt: int
    load: Path | None
    start_rollout_id: int | None
    skipped: tuple[str, ...] = ()
    finetune: bool = False


Plan = TrainPlan | EvalPlan | RolloutOnlyPlan


def resolve_num_rollout(config: RunConfig, num_prompts: int) -> RunConfig:
    """Turn ``--num-epoch`` into ``--num-rollout`` once the dataset size is known (as slime does).

    Returns ``config`` unchanged when ``num_rollout`` is already set.
    """
    r = config.rollout
    if r.num_rollout is not None:
        return config
    assert r.num_epoch is not None  # RunConfig guarantees one of the two
    num_rollout = max(1, r.num_epoch * num_prompts // r.rollout_batch_size)
    return attrs.evolve(config, rollout=attrs.evolve(r, num_rollout=num_rollout))


def _model(config: RunConfig, role: Role) -> ModelSpec:
    """The reference model and a teacher are split like the actor (they share the actor's GPUs);
    the critic has its own rank count (``--critic-num-nodes`` x ``--critic-num-gpus-per-node``).
    Every policy scores at the rollout's sampling temperature (:func:`rlcore.logits.tempered`)."""
    m, k = config.model, config.cluster
    ranks = k.critic_ranks if role == "critic" else k.actor_ranks
    parallel = ParallelSpec(
        tensor=m.tensor_model_parallel_size,
        world_size=ranks,
        expert=m.expert_model_parallel_size,
        pipeline=m.pipeline_model_parallel_size,
    )
    return ModelSpec(
        role=role,
        hf_checkpoint=m.hf_checkpoint,
        seed=config.seed,
        parallel=parallel,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        precision="bfloat16" if m.bf16 else "float32",
        temperature=config.rollout.temperature,
        log_probs_max_tokens_per_gpu=config.train.log_probs_token_budget,
    )


def _eval_params(config: RunConfig) -> SamplingParams:
    e = config.eval
    return SamplingParams(
        max_new_tokens=e.max_response_len or config.rollout.max_response_len,
        temperature=e.temperature,
        top_p=config.rollout.top_p if e.temperature > 0 else 1.0,
        top_k=config.rollout.top_k if e.temperature > 0 else 0,
    )


def _eval_plan(config: RunConfig) -> EvalPlan:
    a = config.algorithm
    skipped: list[str] = ["optimizer and LR scheduler: --num-rollout 0 trains nothing"]
    if a.critic:
        skipped.append(
            "critic: asked for (--use-critic or ppo), but an eval-only run trains nothing"
        )
    if a.uses_kl:
        skipped.append("reference model: KL settings given, but an eval-only run computes no KL")
    if config.opd.use_opd:
        skipped.append("teacher (--use-opd): an eval-only run distills nothing")
    if config.checkpoint.save_hf is not None:
        skipped.append("Hugging Face export (--save-hf): an eval-only run trains nothing")
    return EvalPlan(
        actor=EvalSpec(model=_model(config, "actor")),
        eval_params=_eval_params(config),
        n_samples_per_eval_prompt=config.eval.n_samples_per_eval_prompt,
        load=config.checkpoint.load,
        skipped=tuple(skipped),
    )


def _correction(config: RunConfig) -> ISCorrection | None:
    a = config.algorithm
    if not config.corrects_off_policy:
        return None
    return ISCorrection(
        mode=a.tis_mode,
        level=a.tis_level,
        low=a.tis_clip_low,
        high=a.tis_clip,
        veto_threshold=a.tis_veto_threshold,
        custom_path=a.custom_tis_function_path,
    )


def _rollout_spec(config: RunConfig) -> RolloutSpec:
    r = config.rollout
    return RolloutSpec(
        over_sampling_batch_size=r.over_sampling_batch_size,
        filter_path=r.dynamic_sampling_filter_path,
        keep_surplus=r.over_sampling_surplus == "keep",
        max_rounds=r.dynamic_sampling_max_rounds,
        function_path=r.rollout_function_path,
        save_debug_data=config.debug.save_debug_rollout_data,
    )


def _rollout_params(config: RunConfig) -> SamplingParams:
    r = config.rollout
    return SamplingParams(
        max_new_tokens=r.max_response_len, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
    )


def _train_spec(config: RunConfig, role: Role, lr: float) -> TrainSpec:
    o, a = config.optim, config.algorithm
    schedule = LRSchedule(
        lr=lr,
        min_lr=min(o.min_lr, lr),
        warmup_steps=o.lr_warmup_iters,
        decay_steps=config.lr_decay_steps,
        decay_style=o.lr_decay_style,
    )
    loss = LossSpec(
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip if a.eps_clip_high is None else a.eps_clip_high,
        eps_clip_c=a.eps_clip_c,
        value_clip=a.value_clip,
        entropy_coef=a.entropy_coef,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_loss_type=a.kl_loss_type,
        agg_mode=a.agg_mode,
        agg_constant=config.rollout.max_response_len,
        ratio_level="sequence" if a.advantage_estimator == "gspo" else "token",
        correction=_correction(config),
        use_rollout_logprobs=a.use_rollout_logprobs,
    )
    optimizer = OptimizerSpec(
        schedule=schedule,
        clip_grad=o.clip_grad,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        distributed=o.use_distributed_optimizer,
    )
    return TrainSpec(
        model=_model(config, role),
        optimizer=optimizer,
        loss=loss,
        global_batch_size=config.train.global_batch_size,
        micro_batch_size=config.train.micro_batch_size,
        steps_per_rollout=config.steps_per_rollout,
        load=_load_spec(config),
        max_tokens_per_gpu=config.train.train_token_budget,
    )


def _load_spec(config: RunConfig) -> LoadSpec:
    """What a resume restores (``--finetune``, ``--no-load-optim``,
    ``--override-opt-param-scheduler``)."""
    c = config.checkpoint
    if c.finetune:
        return LoadSpec(optimizer=False, scheduler="fresh")
    return LoadSpec(
        optimizer=not c.no_load_optim,
        scheduler="flags" if c.override_opt_param_scheduler else "saved",
    )


def _train_plan(config: RunConfig, num_rollout: int) -> TrainPlan:
    a, r, e, c = config.algorithm, config.rollout, config.eval, config.checkpoint
    return TrainPlan(
        actor=_train_spec(config, "actor", config.optim.lr),
        critic=_train_spec(config, "critic", config.optim.critic_lr or config.optim.lr)
        if a.critic
        else None,
        reference=EvalSpec(model=_model(config, "reference")) if a.uses_kl else None,
        advantage=AdvantageSpec(
            estimator=a.advantage_estimator,
            group_size=r.n_samples_per_prompt,
            gamma=a.gamma,
            lambd=a.lambd,
            kl_coef=a.kl_coef,
            kl_type=a.kl_penalty_type,
            normalize_std=a.normalize_std,
            whiten=a.normalize_advantages,
        ),
        rollout_params=_rollout_params(config),
        eval_params=_eval_params(config),
        num_rollout=num_rollout,
        rollout_batch_size=r.rollout_batch_size,
        n_samples_per_prompt=r.n_samples_per_prompt,
        n_samples_per_eval_prompt=e.n_samples_per_eval_prompt,
        eval_interval=e.interval,
        eval_before_train=bool(e.prompt_data)
        and not e.skip_eval_before_train
        and not config.debug.replays,
        save_dir=c.save,
        save_interval=c.save_interval,
        load=c.load,
        start_rollout_id=c.start_rollout_id,
        sft_warmup_rollouts=a.sft_warmup_rollouts,
        rollout=_rollout_spec(config),
        replay_rollout_data=config.debug.load_debug_rollout_data,
        finetune=c.finetune,
        max_staleness=r.max_staleness,
        partial_rollout=r.partial_rollout,
        save_retain=c.save_retain,
        save_hf=c.save_hf,
        save_hf_interval=c.save_hf_interval or c.save_interval,
        opd=_opd_spec(config),
        settings=settings_data(config),
    )


def _opd_spec(config: RunConfig) -> OPDSpec | None:
    """The teacher: a server's URL (``--opd-type sglang``), or an eval stack split like the actor,
    in whose slots it runs (as the reference model does). From ``--opd-teacher-load`` the checkpoint
    is found now, once (a later save in that folder does not change the teacher), and its run's
    recorded model folder gives the architecture, as an eval-only ``--load`` takes it
    (:data:`~rlcore.config.saved.EVAL_ONLY_SETTINGS`)."""
    o = config.opd
    if not o.use_opd:
        return None
    if o.served:
        assert o.opd_teacher_url is not None  # the [opd] check requires a server
        served = ServedTeacher(url=o.opd_teacher_url.rstrip("/"))
        return OPDSpec(teacher=served, kl_coef=o.opd_kl_coef, only=o.opd_only)
    folder, load = o.opd_teacher_hf_checkpoint, None
    if o.opd_teacher_load is not None:
        try:
            load = find_checkpoint_of(o.opd_teacher_load, o.opd_teacher_ckpt_step)
            folder = recorded_model_folder(load)
        except CheckpointError as exc:
            raise ConfigError([ConfigProblem(with_flag("opd.opd_teacher_load"), str(exc))]) from exc
    assert folder is not None  # the [opd] check requires a teacher
    teacher = attrs.evolve(_model(config, "teacher"), hf_checkpoint=folder)
    return OPDSpec(
        teacher=EvalSpec(model=teacher), kl_coef=o.opd_kl_coef, teacher_load=load, only=o.opd_only
    )


def _rollout_only_plan(config: RunConfig, num_rollout: int) -> RolloutOnlyPlan:
    a, e = config.algorithm, config.eval
    skipped = ["training stacks, optimizer and LR scheduler: --debug-rollout-only trains nothing"]
    if a.critic:
        skipped.append("critic: asked for (--use-critic or ppo), but nothing is trained")
    if a.uses_kl:
        skipped.append("reference model: KL settings given, but nothing is trained")
    if e.prompt_data:
        skipped.append("evaluation: --debug-rollout-only only generates training rollouts")
    if a.sft_warmup_rollouts:
        skipped.append("--sft-warmup-rollouts: every rollout is generated")
    if config.checkpoint.save_hf is not None:
        skipped.append("Hugging Face export (--save-hf): nothing is trained")
    if config.opd.use_opd:
        skipped.append("teacher (--use-opd): nothing is trained")
    return RolloutOnlyPlan(
        actor=EvalSpec(model=_model(config, "actor")),
        rollout=_rollout_spec(config),
        rollout_params=_rollout_params(config),
        num_rollout=num_rollout,
        rollout_batch_size=config.rollout.rollout_batch_size,
        n_samples_per_prompt=config.rollout.n_samples_per_prompt,
        load=config.checkpoint.load,
        start_rollout_id=config.checkpoint.start_rollout_id,
        skipped=tuple(skipped),
        finetune=config.checkpoint.finetune,
    )


def plan(config: RunConfig) -> Plan:
    """What to build and run: an :class:`EvalPlan` exactly when ``num_rollout`` is 0, a
    :class:`RolloutOnlyPlan` for ``--debug-rollout-only``, else a :class:`TrainPlan`.

    Raises :class:`PlanError` when ``num_rollout`` is still unresolved (``--num-epoch`` without
    :func:`resolve_num_rollout`).
    """
    num_rollout = config.rollout.num_rollout
    if num_rollout is None:
        raise PlanError(
            "num_rollout is not resolved: call resolve_num_rollout(config, len(prompts)) first"
        )
    if num_rollout == 0:
        return _eval_plan(config)
    if config.debug.debug_rollout_only:
        return _rollout_only_plan(config, num_rollout)
    return _train_plan(config, num_rollout)
