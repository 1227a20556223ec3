"""Micro-batches by a token budget in the Megatron stacks (``--use-dynamic-batch-size``): the
train step (actor in every aggregation mode with multi-turn loss masks, and the critic) and the
forward-only passes (log-probs, values) give the numbers of micro-batches by sample count; so
does a mixture-of-experts model, whose router's aux loss is per micro-batch.
Data parallel 2 is in ``test_multirank.py`` (``dp2_budget``)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rlcore.algorithms.token_budget import rank_micro_batches
from rlcore.samples import Sample, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, LossSpec, ModelSpec, TrainSpec
from rlcore_megatron.backend import MegatronBackend
from tests.families import FamilyModels
from tests.megatron.helpers import (
    assert_same_step,
    gradient_step_spec,
    make_batch,
    make_samples,
    train_spec,
    weights,
)
from tests.megatron.test_families import _expected_load_balancing_loss
from tests.megatron.test_stacks import LOSS_VARIANTS

pytestmark = pytest.mark.megatron

BUDGET = 12
"""Padded tokens per micro-batch: the samples (3 to 11 tokens) go 1 to 4 to a micro-batch."""


def _multi_turn(samples: list[Sample]) -> list[Sample]:
    """Every other sample with an environment token (loss mask 0) in its response."""
    out = []
    for i, s in enumerate(samples):
        n = len(s.response.token_ids)
        if i % 2 and n > 1:
            mask = tuple(0 if j == n // 2 else 1 for j in range(n))
            s = attrs.evolve(s, response=attrs.evolve(s.response, loss_mask=mask))
        out.append(s)
    return out


def _padded_and_budget(spec: TrainSpec, batch: TrainBatch) -> tuple[TrainMetrics, TrainMetrics]:
    """The metrics of one train step by sample count, then by the budget; asserts that both
    took the same step (``spec`` is a :func:`gradient_step_spec`, so the step is the gradient:
    Adam's usual first step, a sign, would turn summation-order rounding of a near-zero
    gradient into a whole step)."""
    results, before, after = [], {}, []
    for budget in (None, BUDGET):
        stack = MegatronBackend().build_training_stack(
            attrs.evolve(spec, max_tokens_per_gpu=budget)
        )
        before = weights(stack.export_weights())
        results.append(stack.train_step(batch))
        after.append(weights(stack.export_weights()))
    for name, w in before.items():
        assert_same_step(after[1][name], after[0][name], w, name)
    padded, budgeted = results
    return padded, budgeted


@pytest.mark.parametrize("variant", [*sorted(LOSS_VARIANTS), "critic"])
def test_a_token_budget_does_not_change_the_update(tiny_hf: Path, variant: str) -> None:
    samples = _multi_turn(make_samples(8, seed=7))
    if variant == "critic":
        spec = gradient_step_spec(tiny_hf, role="critic", global_batch_size=8, micro_batch_size=4)
        batch = make_batch(samples, seed=8, returns=True)
    else:
        loss: LossSpec = LOSS_VARIANTS[variant]
        spec = gradient_step_spec(tiny_hf, global_batch_size=8, micro_batch_size=4, loss=loss)
        batch = make_batch(samples, seed=8, old=True, ref=True, rollout=True)
    padded, budget = _padded_and_budget(spec, batch)
    assert padded.grad_norm > 0
    for name in ("loss", "grad_norm", "tokens"):
        assert getattr(budget, name) == pytest.approx(getattr(padded, name), rel=1e-5), name
    assert budget.extra.keys() == padded.extra.keys()
    for key, value in padded.extra.items():
        assert budget.extra[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_forward_passes_return_the_same_values_in_sample_order(tiny_hf: Path) -> None:
    """Log-probs (an eval stack: reference, teacher, eval-only actor) and a critic's values:
    scored longest first in budget micro-batches, returned in the samples' order."""
    samples = _multi_turn(make_samples(7, seed=3))
    backend = MegatronBackend()
    for budget in (1, BUDGET, 10_000):  # every sample alone, a few together, all in one
        padded = backend.build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
        packed = backend.build_eval_stack(
            EvalSpec(ModelSpec("actor", tiny_hf, log_probs_max_tokens_per_gpu=budget))
        )
        expected, got = padded.forward(samples), packed.forward(samples)
        assert [len(r) for r in got] == [len(s.response.token_ids) for s in samples]
        for x, y in zip(got, expected, strict=True):
            assert x == pytest.approx(y, abs=1e-5)
    critic = train_spec(tiny_hf, "critic")
    values = backend.build_training_stack(critic).forward(samples)
    budgeted = attrs.evolve(
        critic, model=attrs.evolve(critic.model, log_probs_max_tokens_per_gpu=BUDGET)
    )
    for x, y in zip(backend.build_training_stack(budgeted).forward(samples), values, strict=True):
        assert x == pytest.approx(y, abs=1e-5)


def test_a_mixture_of_experts_model_under_a_token_budget(family_models: FamilyModels) -> None:
    """Qwen3-MoE: without the router's aux loss the budget's update is the padded one; with it,
    the load-balancing loss is Megatron's per micro-batch (it depends on the cut by definition),
    over exactly the budget's micro-batches, padding left out."""
    folder = family_models.folder("qwen3_moe")
    samples = make_samples(4, seed=3)
    batch = make_batch(samples, seed=4)
    spec = gradient_step_spec(folder)  # global batch 4 in micro-batches of 2
    padded, budget = _padded_and_budget(spec, batch)
    assert budget.loss == pytest.approx(padded.loss, rel=1e-5)
    assert budget.grad_norm == pytest.approx(padded.grad_norm, rel=1e-5)
    with_aux = attrs.evolve(
        spec,
        model=attrs.evolve(spec.model, moe_aux_loss_coeff=1.0),
        max_tokens_per_gpu=BUDGET,
    )
    extra = MegatronBackend().build_training_stack(with_aux).train_step(batch).extra
    lengths = [len(s.prompt.token_ids) + len(s.response.token_ids) for s in samples]
    (plan,) = rank_micro_batches(lengths, BUDGET, 1)
    assert len(plan) > 1
    expected = _expected_load_balancing_loss(folder, [[samples[i] for i in g] for g in plan])
    assert extra["load_balancing_loss"] == pytest.approx(expected, rel=1e-5)
