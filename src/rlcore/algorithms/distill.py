"""On-policy distillation (OPD): the per-token term that pulls a student toward a teacher.

The student samples ``y ~ pi_s``; a frozen teacher ``pi_t`` scores the sampled tokens. The
reverse KL ``KL(pi_s || pi_t) = E_{y~pi_s}[log pi_s(y) - log pi_t(y)]`` has, per sampled token,
the single-sample estimate ``k_t = log pi_s(y_t | y_<t) - log pi_t(y_t | y_<t)`` (Schulman's k1,
:mod:`rlcore.algorithms.kl`). OPD treats ``-k_t`` as a per-token reward and adds it to whatever
the base estimator (GRPO, PPO, REINFORCE++, GSPO) gave the token::

    A'_t = A_t - coef * (log pi_s(y_t) - log pi_t(y_t))

so a token the teacher finds likelier than the student does is pushed up, one it finds less
likely pushed down, on the student's own trajectories. :func:`distillation_advantages` gives the
term ``-coef k_t``; :func:`rlcore.algorithms.advantages.estimate_advantages` adds it
(``token_terms=``) after the estimator and *before* any whitening (``--normalize-advantages``,
REINFORCE++'s), as slime's ``compute_advantages_and_returns`` does, so whitened advantages are
the whitened sum. With ``coef = 0`` the advantages are the base estimator's.

Pure distillation (``--opd-only``): there is no reward and no base estimator, and each token's
advantage is the teacher's signal alone::

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

__all__ = ["OPDAdvantages", "distillation_advantages"]


@attrs.frozen
class OPDAdvantages:
    """The per-token terms ``-coef (student - teacher)``, one row per sample, and over the trained
    tokens (loss mask 1) the mean per-token reverse KL estimate and the teacher's mean log-prob
    (``opd/kl_mean``, ``opd/teacher_logprob_mean``)."""

    advantages: tuple[tuple[float, ...], ...]
    kl_mean: float
    teacher_logprob_mean: float


def distillation_advantages(
    student_log_probs: Sequence[tuple[float, ...]],
    teacher_log_probs: Sequence[tuple[float, ...]],
    coef: float,
    loss_masks: Sequence[tuple[int, ...]] = (),
) -> OPDAdvantages:
    """``-coef * (student_t - teacher_t)`` for every response token of every sample (module
    docstring): the advantages of pure distillation, and OPD's term for ``estimate_advantages``'s
    ``token_terms``. Rows of each sample are as long as its response. ``loss_masks`` say which
    tokens the metrics average over (a sample's mask empty, or none given: every token is trained,
    as :attr:`~rlcore.samples.Generation.loss_mask`); tokens outside the mask (a multi-turn
    episode's observations) get their term too, and the loss ignores them."""
    rows = len(student_log_probs)
    if len(teacher_log_probs) != rows:
        raise ValueError(
            f"distillation_advantages: {rows} student and {len(teacher_log_probs)} teacher "
            "log-prob rows: one of each per sample"
        )
    terms: list[tuple[float, ...]] = []
    kl_sum = teacher_sum = 0.0
    counted = 0
    for i, (student, teacher) in enumerate(zip(student_log_probs, teacher_log_probs, strict=True)):
        if len(student) != len(teacher):
            raise ValueError(
                f"distillation_advantages: sample {i} has {len(student)} student and "
                f"{len(teacher)} teacher log-probs: one per response token"
            )
        terms.append(tuple(-coef * (s - t) for s, t in zip(student, teacher, strict=True)))
        mask = (loss_masks[i] if loss_masks else ()) or (1,) * len(student)
        for s, t, m in zip(student, teacher, mask, strict=True):
            if m:
                kl_sum += s - t
                teacher_sum += t
                counted += 1
    return OPDAdvantages(
        advantages=tuple(terms),
        kl_mean=kl_sum / counted if counted else 0.0,
        teacher_logprob_mean=teacher_sum / counted if counted else 0.0,
    )
