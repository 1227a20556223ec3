"""The ``[opd]`` section: on-policy distillation (slime's flags), and its invariants
(:func:`opd_problems`).

The student (the actor) trains on its own rollouts while a frozen teacher scores every token it
sampled; the per-token reverse KL between them is taken off the advantage
(:func:`rlcore.algorithms.distill.opd_advantages`). The teacher is an eval stack: it never gets an
optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs

from rlcore.config.fields import flag_of, option, problem
from rlcore.errors import ConfigProblem

__all__ = ["OPDConfig", "OPDType", "opd_problems"]

OPDType = Literal["megatron"]
"""Where the teacher runs: ``megatron``, an eval stack the backend builds beside the actor."""


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
        "megatron",
        "--opd-type",
        "where the teacher runs: megatron (an eval stack the backend builds, in the actor's slots)",
    )
    opd_kl_coef: float = option(1.0, "--opd-kl-coef", "weight of the reverse KL to the teacher")
    opd_teacher_hf_checkpoint: Path | None = option(
        None,
        "--opd-teacher-hf-checkpoint",
        "the teacher's HF model folder (its tokenizer must be the student's), e.g. one that "
        "--save-hf wrote",
    )

    @property
    def given(self) -> tuple[str, ...]:
        """The flags of the settings that differ from their defaults, but ``--use-opd``."""
        return tuple(
            flag_of(OPDConfig, f.name)
            for f in attrs.fields(OPDConfig)
            if f.name != "use_opd" and getattr(self, f.name) != f.default
        )


def opd_problems(o: OPDConfig) -> list[ConfigProblem]:
    """A teacher for ``--use-opd``, a coefficient >= 0, and no OPD flag without ``--use-opd``."""
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
    if o.opd_teacher_hf_checkpoint is None:
        add(
            "opd_teacher_hf_checkpoint",
            "--use-opd needs a teacher",
            "add --opd-teacher-hf-checkpoint DIR (an HF model folder with the student's tokenizer)",
        )
    return problems
