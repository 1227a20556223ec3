"""Advantage estimators: rewards (and a critic's values) to per-token advantages and returns.

Tensor functions, each citing what it implements:

- :func:`grpo_advantages` — group-normalised rewards (Shao et al. 2024, DeepSeekMath,
  arXiv:2402.03300); ``normalize_std=False`` is Dr. GRPO (Liu et al. 2025, arXiv:2503.20783).
  GSPO (Zheng et al. 2025, arXiv:2507.18071) uses the same advantages; its sequence-level ratio
  lives in :func:`rlcore.algorithms.losses.policy_loss`.
- :func:`rloo_advantages` — each sample's reward minus the mean reward of the other samples of
  its group, the leave-one-out baseline (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a
  Baseline for Free!"; Ahmadian et al. 2024, RLOO, arXiv:2402.14740).
- :func:`reinforce_plus_plus_advantages` — discounted returns, whitened over the batch
  (Hu 2025, REINFORCE++, arXiv:2501.03262; OpenRLHF's ``reinforce`` estimator).
- :func:`reinforce_plus_plus_baseline_advantages` — group-mean baseline, then whitening (the
  same paper's "REINFORCE++-baseline"; OpenRLHF's ``reinforce_baseline``).
- :func:`gae` — generalised advantage estimation (Schulman et al. 2015, arXiv:1506.02438).

and :func:`estimate_advantages`, the entry point the RL loop calls with ragged Python rows.

Shapes: ``B`` sequences, ``T`` the longest response; ``mask: BoolTensor[B, T]`` is True on the
model's own response tokens: False on padding and, in a multi-turn episode, on the tokens an
environment or tool inserted. Those are not actions: the recursions (:func:`gae`, the discounted
returns of REINFORCE++) skip them, so ``gamma`` and ``lambd`` discount once per *model* token and
an observation neither discounts nor adds a TD error (verl's ``compute_gae_advantage_return``
does the same since its multi-turn support: "skip values and TD-error on observation tokens",
as does RAGEN's masked GAE; slime's ``get_advantages_and_returns_batch`` runs over every response
token, reward on the last, and masks only the losses; OpenRLHF zeroes rewards and values there
but still steps ``gamma`` over them). The outcome reward
sits on the last model token; whitening and means count model tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import attrs
import torch

from rlcore.algorithms.kl import kl_estimate
from rlcore.samples import Sample
from rlcore.specs import GROUPED_ESTIMATORS, AdvantageSpec

__all__ = [
    "Advantages",
    "estimate_advantages",
    "gae",
    "grpo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
]

_WHITEN_EPS = 1e-8
"""Added to the variance before the square root when whitening (slime's and verl's epsilon)."""


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)``: ``rewards: Tensor[B] -> Tensor[B]``.

    Groups are ``group_size`` consecutive entries; ``std_g`` is the unbiased (Bessel, ``n - 1``)
    standard deviation, as in DeepSeekMath (arXiv:2402.03300) and TRL's ``GRPOTrainer``. A group of
    one has advantage 0. ``normalize_std=False`` gives Dr. GRPO's ``r - mean_g`` (arXiv:2503.20783:
    dividing by the std over-weights groups whose rewards barely differ).
    """
    _check_groups(int(rewards.shape[0]), group_size)
    grouped = rewards.reshape(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        if group_size > 1 and grouped.numel():  # torch warns on the std of no groups at all
            std = grouped.std(dim=1, correction=1, keepdim=True)
        else:
            std = torch.zeros_like(centered)
        centered = centered / (std + eps)
    return centered.reshape(rewards.shape)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages ``r_i - mean_{j != i} r_j``: ``rewards: Tensor[B] -> Tensor[B]``.

    Groups are ``group_size`` consecutive entries; each sample's baseline is the mean reward of
    the *other* ``group_size - 1`` samples of its group, so it does not depend on the sample's own
    reward and the policy gradient stays unbiased (Kool et al. 2019; Ahmadian et al. 2024,
    arXiv:2402.14740). Equal to ``n / (n - 1) (r_i - mean_g)``, Dr. GRPO's advantage scaled up.
    A group of one has no other sample: advantage 0 (as verl's vectorised ``rloo``; OpenRLHF
    refuses it, and the config refuses ``n_samples_per_prompt`` 1 with it).
    """
    _check_groups(int(rewards.shape[0]), group_size)
    if group_size == 1:
        return torch.zeros_like(rewards)
    grouped = rewards.reshape(-1, group_size)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others).reshape(rewards.shape)


def reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """REINFORCE++ advantages: ``token_rewards: Tensor[B, T] -> Tensor[B, T]``, 0 where ``mask``
    is False.

    Over the tokens where ``mask`` is True (the model's, module docstring), with ``t'`` the next
    such token after ``t`` in the same row: the discounted return ``G_t = r_t + gamma G_t'``
    (``G_t = r_t`` at a row's last one), so ``G_t = sum_k gamma^(j(k) - j(t)) r_k`` over the
    masked tokens ``k >= t``, ``j`` counting masked tokens (one discount step per model token;
    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` when every token is masked in). Rewards on unmasked
    tokens are ignored. Then whitened over every masked token of the batch: ``(G - mean) /
    sqrt(var + 1e-8)``, ``var`` the unbiased variance (:func:`_masked_whiten`; slime's and verl's
    whitening). Hu 2025, arXiv:2501.03262.
    """
    returns = _discounted_returns(token_rewards * mask, gamma, mask)
    return _masked_whiten(returns, mask)


def reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, group_size: int, mask: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline: ``rewards: Tensor[B]`` (one score per sequence) -> ``Tensor[B, T]``.

    Subtracts each group's mean reward (``group_size`` consecutive sequences), broadcasts the
    result to every token of the sequence where ``mask`` is True and whitens over all those
    tokens of the batch (as :func:`reinforce_plus_plus_advantages`).
    Hu 2025, arXiv:2501.03262, section on REINFORCE++-baseline.
    """
    centered = grpo_advantages(rewards, group_size, normalize_std=False)
    return _masked_whiten(centered.unsqueeze(1) * mask, mask)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2015, arXiv:1506.02438).

    ``token_rewards``, ``values``: ``Tensor[B, T]``; ``values[:, t]`` is ``V(s_t)``, the critic's
    estimate before response token ``t`` is emitted. Over the tokens where ``mask`` is True (the
    actions), with ``t'`` the next such token after ``t``:
    ``delta_t = r_t + gamma V(s_t') - V(s_t)``, ``A_t = delta_t + gamma lambd A_t'`` and
    ``returns_t = A_t + V(s_t)``; the value after a sequence's last action is 0 (the episode
    ends). Tokens where ``mask`` is False (padding, environment observations) are skipped: they
    are not time steps, their rewards and values are ignored (module docstring). Returns
    ``(advantages, returns)``, both ``Tensor[B, T]`` and 0 where ``mask`` is False. Not whitened.
    """
    valid = mask.to(torch.bool)
    rewards = torch.where(valid, token_rewards, torch.zeros_like(token_rewards))
    vals = torch.where(valid, values, torch.zeros_like(values))
    advantages = torch.zeros_like(rewards)
    last = rewards.new_zeros(rewards.shape[0])  # A at the next action
    next_value = rewards.new_zeros(rewards.shape[0])  # V at the next action
    for t in reversed(range(int(rewards.shape[1]))):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        here = delta + gamma * lambd * last
        step = valid[:, t]
        advantages[:, t] = torch.where(step, here, torch.zeros_like(here))
        last = torch.where(step, here, last)
        next_value = torch.where(step, vals[:, t], next_value)
    return advantages, torch.where(valid, advantages + vals, torch.zeros_like(vals))


@final
@attrs.frozen
class Advantages:
    """What :func:`estimate_advantages` returns, one row per sample, each as long as its response.

    ``returns`` are the critic's targets: for ``ppo``, GAE's ``A + V``; for the estimators
    without a critic, what the estimator gave before any ``token_terms`` were added and before
    whitening (``reinforce_plus_plus``: the discounted returns ``G_t``; ``grpo``, ``gspo``,
    ``reinforce_plus_plus_baseline``, ``rloo``: the per-sequence advantage on each model token).
    So they equal ``advantages`` only when nothing was added or whitened (never for REINFORCE++
    and REINFORCE++-baseline, which always whiten). ``kl`` is the mean per-token KL estimate
    against the reference (before ``kl_coef``) over the model's response tokens (a multi-turn
    episode's environment tokens excluded), 0.0 when ``kl_coef == 0``.
    """

    advantages: tuple[tuple[float, ...], ...]
    returns: tuple[tuple[float, ...], ...]
    kl: float = 0.0


_WHITENED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""The estimators whose definition whitens (REINFORCE++, arXiv:2501.03262): whitened whether or
not ``AdvantageSpec.whiten`` asks (slime refuses them without ``--normalize-advantages``)."""


def estimate_advantages(
    samples: Sequence[Sample],
    spec: AdvantageSpec,
    *,
    values: Sequence[tuple[float, ...]] = (),
    log_probs: Sequence[tuple[float, ...]] = (),
    ref_log_probs: Sequence[tuple[float, ...]] = (),
    token_terms: Sequence[tuple[float, ...]] = (),
) -> Advantages:
    """Per-token advantages (and returns) for ``samples`` under ``spec``.

    The per-token reward is ``sample.reward`` on the last model token (the last action), minus
    ``spec.kl_coef * kl_estimate(log_probs, ref_log_probs, spec.kl_type)`` on every model token
    when ``kl_coef > 0`` (then ``log_probs`` and ``ref_log_probs`` are required). ``values`` (the
    critic's ``V(s_t)`` per response token) are required by ``ppo``. Every given row sequence has
    one row per sample, each as long as the sample's response. Model tokens are those of the loss
    mask (:attr:`~rlcore.samples.Generation.model_mask`); every other token reads 0.

    1. The estimator:

       - ``grpo`` / ``gspo`` / ``rloo`` / ``reinforce_plus_plus_baseline``: the sequence's score
         (its summed token rewards: the reward minus ``kl_coef`` times the summed KL) is compared
         within its group of ``spec.group_size`` consecutive samples (:func:`grpo_advantages`;
         :func:`rloo_advantages`; REINFORCE++-baseline only subtracts the group mean) and
         broadcast to every model token.
       - ``reinforce_plus_plus``: the discounted returns of the token rewards (``spec.gamma``;
         :func:`reinforce_plus_plus_advantages` before its whitening).
       - ``ppo``: :func:`gae` with ``spec.gamma`` and ``spec.lambd``; returns are ``A + V``.

    2. ``token_terms`` (optional, one row per sample): added to each model token's advantage.
       On-policy distillation's ``-coef (log pi_student - log pi_teacher)``
       (:func:`rlcore.algorithms.distill.distillation_advantages`) goes here, after the estimator
       and before whitening, where slime's ``compute_advantages_and_returns`` adds it.
    3. Whitening over the model tokens of ``samples`` (:func:`_masked_whiten`: mean 0, unbiased
       variance 1) when ``spec.whiten`` (``--normalize-advantages``) or the estimator is
       REINFORCE++ or REINFORCE++-baseline, which whiten by definition; once either way.

    Returns are taken after step 1 (:class:`Advantages`), so the critic's targets change with
    neither the added terms nor the whitening.

    Samples with empty responses get empty rows (a grouped estimator still counts their reward in
    their group's statistics). Raises ``ValueError`` for a missing input, rows of the wrong length,
    or (grouped estimators) a sample count that is not a multiple of ``group_size`` or a group of
    consecutive samples whose ``group`` ids differ.
    """
    lengths = [len(s.response.token_ids) for s in samples]
    _check_rows("values", values, lengths)
    _check_rows("log_probs", log_probs, lengths)
    _check_rows("ref_log_probs", ref_log_probs, lengths)
    _check_rows("token_terms", token_terms, lengths)
    if spec.estimator in GROUPED_ESTIMATORS:
        _check_groups(len(samples), spec.group_size)
        _check_group_ids(samples, spec.group_size)
    if spec.estimator == "ppo" and samples and not values:
        raise ValueError("estimator 'ppo' needs the critic's values: pass values=...")

    width = max(lengths, default=0)
    dtype = torch.float64  # on the CPU and small: float64 costs nothing and rounds less
    length = torch.tensor(lengths, dtype=torch.long)
    response = torch.arange(width) < length.unsqueeze(1)
    mask = response.clone()
    if any(s.response.loss_mask for s in samples):  # a multi-turn episode: model tokens only
        mask[response] = torch.tensor(
            [bool(m) for s in samples for m in s.response.model_mask], dtype=torch.bool
        )
    rewards = torch.tensor([s.reward for s in samples], dtype=dtype)
    token_rewards = torch.zeros(len(samples), width, dtype=dtype)
    # The outcome reward sits on the last model token (the last action of an episode).
    if width:
        last_action = width - 1 - mask.flip(1).to(torch.long).argmax(dim=1)
        acting = mask.any(dim=1).nonzero().squeeze(1)
        token_rewards[acting, last_action[acting]] = rewards[acting]

    kl_mean = 0.0
    scores = rewards
    if spec.kl_coef > 0:
        for name, rows in (("log_probs", log_probs), ("ref_log_probs", ref_log_probs)):
            if not rows:
                raise ValueError(f"kl_coef = {spec.kl_coef} > 0 needs {name}: pass {name}=...")
        logp = _pad(log_probs, response, dtype)
        kl = kl_estimate(logp, _pad(ref_log_probs, response, dtype), spec.kl_type) * mask
        token_rewards = token_rewards - spec.kl_coef * kl
        scores = rewards - spec.kl_coef * kl.sum(dim=1)
        n_tokens = int(mask.sum())
        kl_mean = float(kl.sum()) / n_tokens if n_tokens else 0.0

    if spec.estimator in ("grpo", "gspo"):  # GSPO differs in the policy loss's ratio only
        adv = grpo_advantages(scores, spec.group_size, spec.normalize_std).unsqueeze(1) * mask
    elif spec.estimator == "rloo":
        adv = rloo_advantages(scores, spec.group_size).unsqueeze(1) * mask
    elif spec.estimator == "reinforce_plus_plus_baseline":
        adv = grpo_advantages(scores, spec.group_size, normalize_std=False).unsqueeze(1) * mask
    elif spec.estimator == "reinforce_plus_plus":
        adv = _discounted_returns(token_rewards * mask, spec.gamma, mask)
    elif spec.estimator == "ppo":
        adv, ret = gae(token_rewards, _pad(values, response, dtype), mask, spec.gamma, spec.lambd)
    else:
        raise ValueError(f"unknown advantage estimator {spec.estimator!r}")
    if spec.estimator != "ppo":
        ret = adv
    if token_terms:
        adv = adv + _pad(token_terms, response, dtype) * mask
    if spec.whiten or spec.estimator in _WHITENED:
        adv = _masked_whiten(adv, mask)
    return Advantages(advantages=_rows(adv, lengths), returns=_rows(ret, lengths), kl=kl_mean)


def _discounted_returns(rewards: torch.Tensor, gamma: float, mask: torch.Tensor) -> torch.Tensor:
    """``G_t = r_t + gamma G_t'`` along dim 1 of ``rewards: Tensor[B, T]``, ``t'`` the next
    position after ``t`` where ``mask`` is True (0 beyond the last); positions where ``mask`` is
    False are skipped (module docstring) and read 0."""
    valid = mask.to(torch.bool)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(int(rewards.shape[1]))):
        here = rewards[:, t] + gamma * running
        running = torch.where(valid[:, t], here, running)
        returns[:, t] = torch.where(valid[:, t], here, torch.zeros_like(here))
    return returns


def _masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` with ``mean`` and the unbiased (Bessel, ``n - 1``)
    variance ``var`` over the ``n`` True entries of ``mask``, as slime's
    ``distributed_masked_whiten`` and verl's ``masked_whiten`` compute it; 0 where ``mask`` is
    False. ``n = 1``: that entry is its own mean, so it reads 0 (slime's result; verl raises);
    ``n = 0``: all 0 (both raise: here a rollout of empty responses trains nothing)."""
    valid = mask.to(torch.bool)
    n = int(valid.sum())
    if n == 0:
        return torch.zeros_like(x)
    kept = torch.where(valid, x, torch.zeros_like(x))
    mean = kept.sum() / n
    centered = torch.where(valid, x - mean, torch.zeros_like(x))
    var = centered.square().sum() / max(n - 1, 1)
    return centered * torch.rsqrt(var + _WHITEN_EPS)


def _check_groups(count: int, group_size: int) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if count % group_size:
        raise ValueError(
            f"{count} samples do not split into groups of {group_size}: a grouped advantage "
            "estimator needs every prompt's n_samples_per_prompt samples, consecutively"
        )


def _check_group_ids(samples: Sequence[Sample], group_size: int) -> None:
    for start in range(0, len(samples), group_size):
        ids = {s.group for s in samples[start : start + group_size]}
        if len(ids) > 1:
            raise ValueError(
                f"samples {start}..{start + group_size - 1} should form one group but carry "
                f"group ids {sorted(ids)}: keep each prompt's samples consecutive"
            )


def _check_rows(name: str, rows: Sequence[tuple[float, ...]], lengths: list[int]) -> None:
    if not rows:
        return
    if len(rows) != len(lengths):
        raise ValueError(f"{name} has {len(rows)} rows for {len(lengths)} samples")
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        if len(row) != n:
            raise ValueError(
                f"{name}[{i}] has {len(row)} entries but sample {i} has {n} response tokens"
            )


def _pad(rows: Sequence[tuple[float, ...]], mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Ragged rows (as long as ``mask``'s rows' True prefixes) as a ``[B, T]`` tensor, 0-padded."""
    out = torch.zeros(mask.shape, dtype=dtype)
    out[mask] = torch.tensor([x for row in rows for x in row], dtype=dtype)
    return out


def _rows(x: torch.Tensor, lengths: list[int]) -> tuple[tuple[float, ...], ...]:
    data = x.tolist()
    return tuple(tuple(row[:n]) for row, n in zip(data, lengths, strict=True))
