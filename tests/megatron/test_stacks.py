"""MegatronBackend's stacks on the CPU: what each holds, train_step, forward, the LR schedule."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rlcore.errors import BackendUnavailableError, ConfigError, PlanError
from rlcore.protocols.stacks import EvalStack, TrainingStack
from rlcore.specs import EvalSpec, ISCorrection, LossSpec, LRSchedule, ModelSpec, ParallelSpec
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.model.hf_weights import load_named_tensors
from rlcore_megatron.stacks import MegatronEvalStack, MegatronTrainingStack
from tests.megatron.helpers import TINY, make_batch, make_samples, train_spec, weights

pytestmark = pytest.mark.megatron


def test_eval_stack_is_a_model_only(tiny_hf: Path) -> None:
    stack = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
    assert isinstance(stack, EvalStack) and not isinstance(stack, TrainingStack)
    assert not hasattr(stack, "optimizer") and not hasattr(stack, "scheduler")
    assert not isinstance(stack.model, DistributedDataParallel)
    assert not stack.model.training
    assert all(not p.requires_grad and p.grad is None for p in stack.model.parameters())
    assert not any(hasattr(p, "main_grad") for p in stack.model.parameters())  # no DDP grad buffer


def test_training_stack_holds_ddp_optimizer_and_scheduler(tiny_hf: Path) -> None:
    stack = MegatronBackend().build_training_stack(train_spec(tiny_hf))
    assert isinstance(stack, TrainingStack)
    assert isinstance(stack.model, DistributedDataParallel)
    assert isinstance(stack.optimizer, MegatronOptimizer)
    assert isinstance(stack.scheduler, OptimizerParamScheduler)
    assert stack.optimizer.config.min_lr == 1e-4
    assert all(group["fused"] for group in stack.optimizer.param_groups)  # the fast CPU AdamW


def test_eval_and_training_forward_agree_with_each_other(tiny_hf: Path) -> None:
    samples = make_samples(5, seed=3)
    ev = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
    tr = MegatronBackend().build_training_stack(train_spec(tiny_hf))
    a, b = ev.forward(samples), tr.forward(samples)
    assert [len(r) for r in a] == [len(s.response.token_ids) for s in samples]
    assert all(lp < 0 for row in a for lp in row)
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, abs=1e-6)
    ev.forward_micro_batch = 2  # the micro-batch split does not change the result
    for x, y in zip(a, ev.forward(samples), strict=True):
        assert x == pytest.approx(y, abs=1e-5)


def test_actor_train_step_learns_and_reports(tiny_hf: Path) -> None:
    stack = MegatronBackend().build_training_stack(
        train_spec(tiny_hf, global_batch_size=4, steps_per_rollout=2)
    )
    samples = make_samples(8, seed=1)
    batch = make_batch(samples, seed=2)
    before = weights(stack.export_weights())
    metrics = stack.train_step(batch)
    after = weights(stack.export_weights())
    assert metrics.tokens == sum(len(s.response.token_ids) for s in samples[4:])
    assert metrics.grad_norm > 0 and metrics.lr == pytest.approx(
        stack.optimizer.param_groups[0]["lr"], rel=0.2
    )
    assert {"pg_loss", "clipfrac", "approx_kl"} <= set(metrics.extra)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert stack.scheduler.num_steps == 2


def test_positive_advantages_raise_the_log_probs(tiny_hf: Path) -> None:
    from rlcore.samples import TrainBatch

    samples = make_samples(4, seed=5)
    stack = MegatronBackend().build_training_stack(
        train_spec(
            tiny_hf, schedule=LRSchedule(lr=1e-2, min_lr=1e-2, warmup_steps=0, decay_steps=1)
        )
    )
    before = stack.forward(samples)
    ones = tuple(tuple(1.0 for _ in s.response.token_ids) for s in samples)
    stack.train_step(TrainBatch(tuple(samples), ones))
    after = stack.forward(samples)
    assert sum(map(sum, after)) > sum(map(sum, before))


LOSS_VARIANTS = {
    "grpo-kl-entropy-dual-clip": LossSpec(
        use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, eps_clip_c=1.2
    ),
    "token-mean-tis": LossSpec(
        agg_mode="token-mean", correction=ISCorrection(low=0.5, high=2.0, veto_threshold=1e-3)
    ),
    "dr-grpo-gspo-geometric-mask": LossSpec(
        agg_mode="seq-mean-token-sum-budget",
        agg_constant=6,
        ratio_level="sequence",
        eps_clip=0.1,
        eps_clip_high=0.3,
        correction=ISCorrection(mode="mask", level="geometric", low=0.0, high=3.0),
    ),
}


@pytest.mark.parametrize("variant", sorted(LOSS_VARIANTS))
def test_micro_batch_split_does_not_change_the_update(tiny_hf: Path, variant: str) -> None:
    """Every aggregation mode, ratio level and correction: the loss scaling is exact whatever the
    micro-batch split (each micro-batch over the global batch's normaliser)."""
    samples = make_samples(4, seed=7)
    batch = make_batch(samples, seed=8, old=True, ref=True, rollout=True)
    loss = LOSS_VARIANTS[variant]
    if loss.eps_clip_c is not None:  # old log-probs far below the model's: ratios well above c
        lowered = tuple(tuple(x - 5.0 for x in row) for row in batch.old_log_probs)
        batch = attrs.evolve(batch, old_log_probs=lowered)
    results = []
    for micro in (1, 4):
        stack = MegatronBackend().build_training_stack(
            train_spec(tiny_hf, micro_batch_size=micro, loss=loss)
        )
        metrics = stack.train_step(batch)
        results.append((metrics, weights(stack.export_weights())))
    (m1, w1), (m4, w4) = results
    assert m1.loss == pytest.approx(m4.loss, rel=1e-5)
    assert m1.grad_norm == pytest.approx(m4.grad_norm, rel=1e-4)
    assert m1.grad_norm > 0
    assert m1.extra["logprob_mismatch_max"] == m4.extra["logprob_mismatch_max"] > 0
    if loss.use_kl_loss:
        assert {"kl_loss", "entropy"} <= set(m1.extra)
    if loss.correction is not None:
        assert m1.extra["tis_weight"] == pytest.approx(m4.extra["tis_weight"], rel=1e-5)
    if loss.eps_clip_c is not None:  # a token mean over the global batch, whatever the split
        assert m1.extra["dual_clipfrac"] == pytest.approx(m4.extra["dual_clipfrac"], rel=1e-6)
        assert m1.extra["dual_clipfrac"] > 0
    for name in w1:
        torch.testing.assert_close(w1[name], w4[name], rtol=1e-5, atol=1e-6)


def test_lr_follows_the_schedule(tiny_hf: Path) -> None:
    schedule = LRSchedule(lr=1e-3, min_lr=1e-5, warmup_steps=2, decay_steps=5, decay_style="cosine")
    stack = MegatronBackend().build_training_stack(
        train_spec(
            tiny_hf, global_batch_size=2, micro_batch_size=2, schedule=schedule, clip_grad=0.0
        )
    )
    batch = make_batch(make_samples(2, seed=4))
    lrs = [stack.train_step(batch).lr for _ in range(7)]
    assert lrs == pytest.approx([schedule.lr_at(step) for step in range(7)], rel=1e-6, abs=1e-12)


def test_critic_trains_on_returns(tiny_hf: Path) -> None:
    backend = MegatronBackend()
    stack = backend.build_training_stack(train_spec(tiny_hf, "critic"))
    samples = make_samples(4, seed=9)
    values = stack.forward(samples)
    assert [len(v) for v in values] == [len(s.response.token_ids) for s in samples]
    batch = make_batch(samples, seed=10, returns=True)
    first = stack.train_step(batch)
    for _ in range(5):
        last = stack.train_step(batch)
    assert "value_loss" in first.extra and last.loss < first.loss
    assert "score.weight" in dict(stack.export_weights())


def test_wrong_batch_size_is_refused(tiny_hf: Path) -> None:
    stack = MegatronBackend().build_training_stack(train_spec(tiny_hf, global_batch_size=4))
    with pytest.raises(PlanError, match="global_batch_size=4"):
        stack.train_step(make_batch(make_samples(3)))


def test_a_spec_for_another_layout_is_refused(tiny_hf: Path) -> None:
    # A TrainSpec's batch split is checked against its own ParallelSpec, so it must be the ranks'.
    spec = EvalSpec(ModelSpec("actor", tiny_hf, parallel=ParallelSpec(1, 2)))
    with pytest.raises(BackendUnavailableError, match=r"world_size=2 .* one of 1 torch"):
        MegatronBackend().build_eval_stack(spec)


def test_random_init_needs_an_architecture() -> None:
    with pytest.raises(ConfigError, match="hf_checkpoint"):
        MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", None)))


def test_random_init_from_config_is_seeded(megatron_rank: None) -> None:
    cfg = {
        "model_type": "llama",
        "vocab_size": TINY["vocab_size"],
        "hidden_size": TINY["hidden_size"],
        "intermediate_size": TINY["intermediate_size"],
        "num_hidden_layers": TINY["num_layers"],
        "num_attention_heads": TINY["num_heads"],
        "num_key_value_heads": TINY["num_kv_heads"],
    }
    backend = MegatronBackend(hf_config=cfg)
    a = weights(
        backend.build_eval_stack(EvalSpec(ModelSpec("actor", None, seed=3))).export_weights()
    )
    b = weights(
        backend.build_eval_stack(EvalSpec(ModelSpec("actor", None, seed=3))).export_weights()
    )
    c = weights(
        backend.build_eval_stack(EvalSpec(ModelSpec("actor", None, seed=4))).export_weights()
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_weights_move_from_training_to_eval_stack(tiny_hf: Path) -> None:
    tr = MegatronBackend().build_training_stack(train_spec(tiny_hf))
    tr.train_step(make_batch(make_samples(4, seed=11)))
    ev = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("reference", tiny_hf)))
    assert isinstance(ev, MegatronEvalStack) and isinstance(tr, MegatronTrainingStack)
    load_named_tensors(ev.model, tr.export_weights(), ev.arch, "reference")
    samples = make_samples(3, seed=12)
    for x, y in zip(ev.forward(samples), tr.forward(samples), strict=True):
        assert x == pytest.approx(y, abs=1e-6)
