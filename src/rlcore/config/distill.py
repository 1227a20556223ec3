"""The ``[opd]`` section: on-policy distillation (slime's flags), and its invariants
(:func:`opd_problems`).

The student (the actor) trains on its own rollouts while a frozen teacher scores every token it
sampled; the per-token reverse KL between them is taken off the advantage before any whitening
(:mod:`rlcore.algorithms.distill`). The teacher is an eval stack: it never gets an
optimizer. With ``--opd-type backend`` (the default; ``megatron`` is slime's name for it) its
weights come from exactly one place: a Hugging Face folder (``--opd-teacher-hf-checkpoint``) or
the actor of an rlcore checkpoint
(``--opd-teacher-load``, ``--opd-teacher-ckpt-step``), built with the model folder that
checkpoint's run recorded, as an eval-only ``--load`` is. With ``--opd-type sglang`` the teacher
is an SGLang server someone runs (``--opd-teacher-url``, slime's ``--rm-url`` in its OPD example),
asked for its log-probs of each rollout as the rollout is made. ``--opd-only`` distills without a
reward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs

from rlcore.config.algorithm import AlgorithmConfig
from rlcore.config.fields import flag_of, option, problem
from rlcore.errors import ConfigProblem

__all__ = ["OPDConfig", "OPDType", "opd_problems"]

OPDType = Literal["backend", "megatron", "sglang"]
"""The teacher's kind: ``backend``, an eval stack the training backend (``--train-backend``, any)
builds beside the actor, which scores each rollout at train time (``megatron`` is slime's name
for it, kept: it means the same with any backend); ``sglang``, an SGLang server that scores each
rollout as it is made (during rollout, so under ``--max-staleness`` it overlaps training)."""


@attrs.frozen
class OPDConfig:
    """On-policy distillation from a frozen teacher."""

    use_opd: bool = option(
        False,
        "--use-opd",
        "on-policy distillation: the advantage of every sampled token loses --opd-kl-coef times "
        "the student's log-prob minus the teacher's (reverse KL), on top of any estimator",
    )
    opd_type: OPDType = option(
        "backend",
        "--opd-type",
        "the teacher's kind: backend (an eval stack the training backend builds, in the actor's "
        "slots; megatron, slime's name, means the same) or sglang (an SGLang server at "
        "--opd-teacher-url scores each rollout as it is made)",
    )

    @property
    def served(self) -> bool:
        """Whether the teacher is a server (``--opd-type sglang``), not a stack the run builds."""
        return self.opd_type == "sglang"

    opd_kl_coef: float = option(1.0, "--opd-kl-coef", "weight of the reverse KL to the teacher")
    opd_teacher_hf_checkpoint: Path | None = option(
        None,
        "--opd-teacher-hf-checkpoint",
        "the teacher's HF model folder (its tokenizer must be the student's), e.g. one that "
        "--save-hf wrote",
    )
    opd_teacher_load: Path | None = option(
        None,
        "--opd-teacher-load",
        "instead: the teacher is the actor of an rlcore checkpoint, a --save folder (its latest, "
        "or --opd-teacher-ckpt-step) or one rollout_* inside it; weights only, built with the "
        "model folder that checkpoint's run recorded (slime's flag)",
    )
    opd_teacher_url: str | None = option(
        None,
        "--opd-teacher-url",
        "with --opd-type sglang: the URL of an SGLang server running the teacher "
        "(http://HOST:PORT; its tokenizer must be the student's)",
    )
    opd_teacher_ckpt_step: int | None = option(
        None,
        "--opd-teacher-ckpt-step",
        "with --opd-teacher-load DIR: the checkpoint of rollout N (DIR/rollout_NNNNNN, N the "
        "count of rollouts done) instead of the latest (slime's flag)",
    )
    opd_only: bool = option(
        False,
        "--opd-only",
        "pure distillation, for prompts without a verifier: training samples are not scored "
        "(no reward function, no labels read from --prompt-data) and each token's advantage is "
        "exactly -(--opd-kl-coef) times the student's minus the teacher's log-prob",
    )

    @property
    def given(self) -> tuple[str, ...]:
        """The flags of the settings that differ from their defaults, but ``--use-opd``."""
        return tuple(
            flag_of(OPDConfig, f.name)
            for f in attrs.fields(OPDConfig)
            if f.name != "use_opd" and getattr(self, f.name) != f.default
        )


def opd_problems(o: OPDConfig, a: AlgorithmConfig) -> list[ConfigProblem]:
    """A teacher for ``--use-opd`` named once (weights for ``--opd-type backend``, a server's URL
    for ``sglang``), a coefficient >= 0, a checkpoint step only with a checkpoint, nothing that
    needs a reward with ``--opd-only`` (the algorithm settings ``a``), and no OPD flag without
    ``--use-opd``."""
    problems: list[ConfigProblem] = []

    def add(name: str, message: str, hint: str = "") -> None:
        problems.append(problem(OPDConfig, "opd", name, message, hint))

    if not o.use_opd:
        for flag in o.given:
            add(
                flag.removeprefix("--").replace("-", "_"),
                "has no effect without --use-opd",
                "add --use-opd, or drop it",
            )
        return problems
    if o.opd_kl_coef < 0:
        add("opd_kl_coef", f"must be >= 0, got {o.opd_kl_coef}")
    if o.served:
        problems += _served_teacher_problems(o)
    elif o.opd_teacher_url is not None:
        add(
            "opd_teacher_url",
            f"names a teacher server, but --opd-type {o.opd_type} builds the teacher itself",
            "add --opd-type sglang to distill from that server, or drop --opd-teacher-url",
        )
    elif o.opd_teacher_hf_checkpoint is None and o.opd_teacher_load is None:
        add(
            "opd_teacher_hf_checkpoint",
            "--use-opd needs a teacher",
            "add --opd-teacher-hf-checkpoint DIR (an HF model folder with the student's tokenizer) "
            "or --opd-teacher-load DIR (an rlcore checkpoint)",
        )
    elif o.opd_teacher_hf_checkpoint is not None and o.opd_teacher_load is not None:
        add(
            "opd_teacher_load",
            f"names the teacher's weights, and so does --opd-teacher-hf-checkpoint "
            f"{o.opd_teacher_hf_checkpoint}: a teacher has one set of weights",
            "keep one of the two (a checkpoint's architecture is the model folder its run "
            "recorded)",
        )
    if o.opd_teacher_ckpt_step is not None and not o.served:
        if o.opd_teacher_load is None:
            add(
                "opd_teacher_ckpt_step",
                "picks a checkpoint of --opd-teacher-load, which is not given",
                "add --opd-teacher-load DIR (a --save folder), or drop it",
            )
        elif o.opd_teacher_ckpt_step < 1:
            add(
                "opd_teacher_ckpt_step",
                f"must be >= 1 (rollouts are counted from 1), got {o.opd_teacher_ckpt_step}",
            )
    if o.opd_only:
        problems += _reward_free_problems(o, a)
    return problems


def _served_teacher_problems(o: OPDConfig) -> list[ConfigProblem]:
    """``--opd-type sglang``: the teacher is the server at ``--opd-teacher-url``, whose weights
    are its own (slime: ``--opd-teacher-load`` must not be set in this mode)."""
    problems: list[ConfigProblem] = []
    if o.opd_teacher_url is None:
        problems.append(
            problem(
                OPDConfig,
                "opd",
                "opd_teacher_url",
                "--opd-type sglang needs the teacher's server",
                "start one on the teacher's folder (python -m sglang.launch_server --model-path "
                "DIR ...) and pass its URL, or use --opd-type backend",
            )
        )
    elif not o.opd_teacher_url.startswith(("http://", "https://")):
        problems.append(
            problem(
                OPDConfig,
                "opd",
                "opd_teacher_url",
                f"must be an http:// or https:// URL, got {o.opd_teacher_url!r}",
                "pass the server's address, e.g. http://127.0.0.1:30000",
            )
        )
    given = [
        ("opd_teacher_hf_checkpoint", o.opd_teacher_hf_checkpoint),
        ("opd_teacher_load", o.opd_teacher_load),
        ("opd_teacher_ckpt_step", o.opd_teacher_ckpt_step),
    ]
    for name, value in given:
        if value is not None:
            problems.append(
                problem(
                    OPDConfig,
                    "opd",
                    name,
                    "names the teacher's weights, but with --opd-type sglang the server at "
                    "--opd-teacher-url serves its own",
                    "drop it (start the server on those weights), or use --opd-type backend",
                )
            )
    return problems


def _reward_free_problems(o: OPDConfig, a: AlgorithmConfig) -> list[ConfigProblem]:
    """``--opd-only`` has no reward: refuse what would learn from one, or need labels."""
    problems: list[ConfigProblem] = []
    hint = "drop it: with --opd-only the teacher is the only signal (or drop --opd-only)"
    if o.opd_kl_coef == 0:
        problems.append(
            problem(
                OPDConfig,
                "opd",
                "opd_only",
                "with --opd-kl-coef 0 every advantage is 0: nothing would be learned",
                "raise --opd-kl-coef",
            )
        )
    wanted = [
        ("use_critic", a.critic, "a critic learns the value of a reward"),
        ("kl_coef", a.kl_coef != 0, "a KL penalty on the reward shapes a reward there is not"),
        ("sft_warmup_rollouts", a.sft_warmup_rollouts > 0, "a warm start trains on the labels"),
        ("normalize_advantages", a.normalize_advantages, "whitening changes the advantages"),
    ]
    for name, on, why in wanted:
        if on:
            flag = flag_of(AlgorithmConfig, name)
            if name == "use_critic" and not a.use_critic:
                flag = "--advantage-estimator ppo"
            problems.append(
                problem(
                    AlgorithmConfig,
                    "algorithm",
                    name,
                    f"{flag} does not go with --opd-only: {why}, and each token's advantage is "
                    "the teacher's reverse KL alone",
                    hint,
                )
            )
    return problems
