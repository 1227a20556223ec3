"""Environment tokens get exactly zero gradient on the real Megatron stack (GRPO, and PPO with a
critic): training on multi-turn episodes gives the same update as training on the episodes with
those tokens removed from the loss.

Two ways of removing them. Trailing environment tokens (an episode cut off after a tool result)
can be removed *physically*: under causal attention nothing before them sees them, so the batch
without them must give the same update (up to float rounding of the different padded shapes).
Environment tokens in the middle of an episode are context for the model's later turns and cannot
be dropped; there the update must not depend on anything the batch holds at their positions
(advantages, returns, old values, old/reference/engine log-probs): bit-identical weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import pytest
import torch

from rlcore.algorithms.advantages import estimate_advantages
from rlcore.samples import Generation, Prompt, Sample, TrainBatch
from rlcore.specs import AdvantageSpec, ISCorrection, LossSpec
from rlcore_megatron.backend import MegatronBackend
from tests.megatron.helpers import train_spec, weights

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

LOSS = LossSpec(
    agg_mode="token-mean",
    correction=ISCorrection(low=0.5, high=2.0),
    use_kl_loss=True,
    kl_loss_coef=0.1,
    entropy_coef=0.01,
)


def episode(index: int, pieces: list[tuple[int, int]], reward: float, seed: int) -> Sample:
    """A sample whose response is ``pieces``: runs of (token count, 1 = model / 0 = environment);
    engine log-probs are 0.0 on environment tokens, as an episode records them."""
    rng = random.Random(seed)
    tokens: list[int] = []
    mask: list[int] = []
    for count, is_model in pieces:
        tokens.extend(rng.randrange(3, 32) for _ in range(count))
        mask.extend([is_model] * count)
    logp = tuple(-rng.uniform(2.5, 3.5) if m else 0.0 for m in mask)
    gen = Generation(tuple(tokens), logp, "", "stop", loss_mask=tuple(mask))
    prompt = (1, *(rng.randrange(3, 32) for _ in range(2)))
    return Sample(Prompt(index, "", prompt), gen, reward, group=index // 2)


def cut_trailing_env(s: Sample) -> Sample:
    mask = list(s.response.model_mask)
    keep = len(mask) - next(i for i, m in enumerate(reversed(mask)) if m)
    r = s.response
    gen = Generation(
        r.token_ids[:keep], r.log_probs[:keep], "", "stop", loss_mask=r.loss_mask[:keep]
    )
    return attrs.evolve(s, response=gen)


def train_once(
    hf: Path,
    samples: list[Sample],
    estimator: str,
    junk_seed: int | None = None,
    given: tuple[tuple[tuple[float, ...], ...], ...] = (),
) -> tuple[dict[str, torch.Tensor], tuple[tuple[tuple[float, ...], ...], ...]]:
    """One rollout's training of fresh stacks from ``hf`` on ``samples`` (advantages from
    ``estimator``; the critic first for ``ppo``), returning the actor's (and critic's) weights.
    ``junk_seed``: overwrite every per-token input at environment positions with random values.
    ``given``: the reference log-probs and critic values to use (each row cut to its sample's
    length) instead of computing them: a forward over a differently padded batch rounds its last
    bits differently, and Adam's first step turns such noise in near-zero gradients into full
    steps. Returns the weights and the (reference, values) rows used."""
    backend = MegatronBackend()
    actor = backend.build_training_stack(train_spec(hf, loss=LOSS))
    critic = (
        backend.build_training_stack(train_spec(hf, "critic", loss=LOSS))
        if estimator == "ppo"
        else None
    )
    if given:
        lengths = [len(s.response.token_ids) for s in samples]
        ref, values = (
            tuple(r[:n] for r, n in zip(rows, lengths, strict=True)) if rows else ()
            for rows in given
        )
    else:
        ref = tuple(actor.forward(samples))
        values = tuple(critic.forward(samples)) if critic is not None else ()
    spec = AdvantageSpec(estimator, group_size=2, gamma=0.95, lambd=0.9)  # type: ignore[arg-type]  # a literal estimator
    adv = estimate_advantages(samples, spec, values=values)
    rng = random.Random(junk_seed)

    def junk(rows: tuple[tuple[float, ...], ...]) -> tuple[tuple[float, ...], ...]:
        if junk_seed is None or not rows:
            return rows
        return tuple(
            tuple(
                x if m else rng.uniform(-30, 30)
                for x, m in zip(row, s.response.model_mask, strict=True)
            )
            for row, s in zip(rows, samples, strict=True)
        )

    batch = TrainBatch(
        samples=tuple(samples),
        advantages=junk(adv.advantages),
        returns=junk(adv.returns) if critic is not None else (),
        ref_log_probs=junk(ref),
        old_values=junk(values),
        rollout_log_probs=junk(tuple(s.response.log_probs for s in samples)),
    )
    out: dict[str, torch.Tensor] = {}
    if critic is not None:
        metrics = critic.train_step(batch)
        assert metrics.tokens == sum(s.response.model_tokens for s in samples)
        out.update({f"critic/{k}": v for k, v in weights(critic.export_weights()).items()})
    metrics = actor.train_step(batch)
    assert metrics.tokens == sum(s.response.model_tokens for s in samples)
    out.update({f"actor/{k}": v for k, v in weights(actor.export_weights()).items()})
    return out, (ref, values)


def episodes() -> list[Sample]:
    return [
        episode(0, [(2, 1), (3, 0), (2, 1), (2, 0)], 1.0, 1),
        episode(1, [(1, 1), (2, 0), (3, 1)], 0.0, 2),
        episode(2, [(3, 1), (4, 0)], 0.5, 3),
        episode(3, [(2, 1), (1, 0), (1, 1), (3, 0)], 0.0, 4),
    ]


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_trailing_environment_tokens_change_nothing(tiny_hf: Path, estimator: str) -> None:
    samples = episodes()
    full, scored = train_once(tiny_hf, samples, estimator)
    cut, _ = train_once(tiny_hf, [cut_trailing_env(s) for s in samples], estimator, given=scored)
    assert full.keys() == cut.keys()
    for name in full:
        torch.testing.assert_close(full[name], cut[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("estimator", ["grpo", "ppo"])
def test_inputs_at_environment_tokens_change_nothing(tiny_hf: Path, estimator: str) -> None:
    samples = episodes()
    clean, scored = train_once(tiny_hf, samples, estimator)
    junk, _ = train_once(tiny_hf, samples, estimator, junk_seed=7, given=scored)
    plain, _ = train_once(
        tiny_hf,
        [attrs.evolve(s, response=attrs.evolve(s.response, loss_mask=())) for s in samples],
        estimator,
    )
    moved = [n for n in clean if not torch.equal(clean[n], plain[n])]
    assert moved, "training on environment tokens too must give another update (the test can fail)"
    for name in clean:
        assert torch.equal(clean[name], junk[name]), name
