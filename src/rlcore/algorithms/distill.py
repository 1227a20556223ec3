"""On-policy distillation (OPD): the advantage adjustment that pulls a student toward a teacher.

The student samples ``y ~ pi_s``; a frozen teacher ``pi_t`` scores the sampled tokens. The
reverse KL ``KL(pi_s || pi_t) = E_{y~pi_s}[log pi_s(y) - log pi_t(y)]`` has, per sampled token,
the single-sample estimate ``k_t = log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t)`` (Schulman's k1,
:mod:`rlcore.algorithms.kl`). OPD treats ``-k_t`` as a per-token reward and adds it to whatever
the base estimator (GRPO, PPO, REINFORCE++, GSPO) gave the token::

    A'_t = A_t - coef * (log pi_s(y_t) - log pi_t(y_t))

so a token the teacher finds likelier than the student does is pushed up, one it finds less
likely pushed down, on the student's own trajectories. With ``coef = 0`` the advantages are the
base estimator's, bit for bit.

Pure distillation (``--opd-only``, :func:`distillation_advantages`): there is no reward and no
base estimator, and each token's advantage is the teacher's signal alone::

    A_t = -coef * (log pi_s(y_t) - log pi_t(y_t))

(Thinking Machines' recipe, with no discount: each token's own reverse KL, not a sum over the rest
of the sequence.)

Sources: Agarwal et al., "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes" (GKD, ICLR 2024); Thinking Machines, "On-Policy Distillation" (2025),
whose per-token reverse-KL advantage this is; slime's ``--use-opd`` (``A_t - opd_kl_coef *
KL_t``), whose flag names the config keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

__all__ = ["OPDAdvantages", "distillation_advantages", "opd_advantages"]


@attrs.frozen
class OPDAdvantages:
    """The adjusted advantages, and over the trained tokens (loss mask 1) the mean per-token
    reverse KL estimate and the teacher's mean log-prob (``opd/kl_mean``,
    ``opd/teacher_logprob_mean``)."""

    advantages: tuple[tuple[float, ...], ...]
    kl_mean: float
    teacher_logprob_mean: float


def opd_advantages(
    advantages: Sequence[tuple[float, ...]],
    student_log_probs: Sequence[tuple[float, ...]],
    teacher_log_probs: Sequence[tuple[float, ...]],
    coef: float,
    loss_masks: Sequence[tuple[int, ...]] = (),
) -> OPDAdvantages:
    """``A_t - coef * (student_t - teacher_t)`` for every response token of every sample (module
    docstring); rows of each sample are as long as its response. ``loss_masks`` say which tokens
    the metrics average over (a sample's mask empty, or none given: every token is trained, as
    :attr:`~rlcore.samples.Generation.loss_mask`); tokens outside the mask (a multi-turn episode's
    observations) are adjusted too, and the loss ignores them."""
    return _distilled(advantages, student_log_probs, teacher_log_probs, coef, loss_masks)


def distillation_advantages(
    student_log_probs: Sequence[tuple[float, ...]],
    teacher_log_probs: Sequence[tuple[float, ...]],
    coef: float,
    loss_masks: Sequence[tuple[int, ...]] = (),
) -> OPDAdvantages:
    """Pure distillation: ``-coef * (student_t - teacher_t)`` for every response token, with no
    base advantage at all (module docstring); the metrics and ``loss_masks`` as in
    :func:`opd_advantages`."""
    return _distilled(None, student_log_probs, teacher_log_probs, coef, loss_masks)


def _distilled(
    advantages: Sequence[tuple[float, ...]] | None,
    student_log_probs: Sequence[tuple[float, ...]],
    teacher_log_probs: Sequence[tuple[float, ...]],
    coef: float,
    loss_masks: Sequence[tuple[int, ...]],
) -> OPDAdvantages:
    """:func:`opd_advantages`, or with ``advantages`` None :func:`distillation_advantages`."""
    if advantages is None:
        advantages = [(0.0,) * len(row) for row in student_log_probs]
        base = False
    else:
        base = True
    rows = len(advantages)
    if not len(student_log_probs) == len(teacher_log_probs) == rows:
        raise ValueError(
            f"opd_advantages: {rows} advantage rows, {len(student_log_probs)} student and "
            f"{len(teacher_log_probs)} teacher log-prob rows: one of each per sample"
        )
    adjusted: list[tuple[float, ...]] = []
    kl_sum = teacher_sum = 0.0
    counted = 0
    for i, (adv, student, teacher) in enumerate(
        zip(advantages, student_log_probs, teacher_log_probs, strict=True)
    ):
        if not len(adv) == len(student) == len(teacher):
            raise ValueError(
                f"opd_advantages: sample {i} has {len(adv)} advantages, {len(student)} student "
                f"and {len(teacher)} teacher log-probs: one per response token"
            )
        if base:
            row = tuple(a - coef * (s - t) for a, s, t in zip(adv, student, teacher, strict=True))
        else:
            row = tuple(-coef * (s - t) for s, t in zip(student, teacher, strict=True))
        adjusted.append(row)
        mask = (loss_masks[i] if loss_masks else ()) or (1,) * len(adv)
        for s, t, m in zip(student, teacher, mask, strict=True):
            if m:
                kl_sum += s - t
                teacher_sum += t
                counted += 1
    return OPDAdvantages(
        advantages=tuple(adjusted),
        kl_mean=kl_sum / counted if counted else 0.0,
        teacher_logprob_mean=teacher_sum / counted if counted else 0.0,
    )
