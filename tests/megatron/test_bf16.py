"""``--bf16`` on the CPU: Megatron's mixed precision (bf16 weights and activations; fp32 main
weights, optimizer state and gradient reduction), through the optimizer classes a GPU uses."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from megatron.core import dist_checkpointing
from megatron.core.optimizer import MegatronOptimizer

from rlcore.errors import CheckpointError
from rlcore.samples import Sample, TrainBatch
from rlcore.specs import EvalSpec, LRSchedule, ModelSpec, Precision, Role
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.model.arch import read_hf_config
from rlcore_megatron.model.gpt import build_gpt
from rlcore_megatron.model.hf_weights import export_hf_weights, load_hf_weights
from rlcore_megatron.stacks import MegatronTrainingStack
from tests.families import FAMILIES, Family, FamilyModels
from tests.megatron.helpers import (
    make_batch,
    make_samples,
    optimizer_parts,
    train_spec,
    weights,
)
from tests.megatron.test_families import megatron_logits, random_tokens

pytestmark = pytest.mark.megatron

STEPS = 20
SCHEDULE = LRSchedule(lr=1e-2, min_lr=1e-3, warmup_steps=0, decay_steps=STEPS, decay_style="cosine")
# How closely 20 bf16 steps track the same 20 fp32 steps (measured: at most 0.4% for the actor's
# loss; 0.014 for the critic's, at a spike to 0.29 in step 4 that both precisions take at this
# learning rate, 0.005 elsewhere; the fp32 losses themselves fall by 2.5 and 0.12).
ACTOR_REL_TOL = 0.02
CRITIC_ABS_TOL = 0.02
# bf16 Megatron logits vs transformers' bf16 logits of the same tiny random family models, whose
# logits are within +-1.4: a few bf16 rounding steps (2**-7 at 1) apart; measured at most 0.0094.
FAMILY_LOGITS_ATOL = 0.04


def _stack(
    hf: Path, precision: Precision, role: Role = "actor", *, distributed: bool = False
) -> MegatronTrainingStack:
    spec = train_spec(
        hf,
        role,
        global_batch_size=8,
        micro_batch_size=4,
        schedule=SCHEDULE,
        precision=precision,
        distributed_optimizer=distributed,
    )
    return MegatronBackend().build_training_stack(spec)


def _inner(optimizer: MegatronOptimizer) -> Any:
    (part,) = optimizer_parts(optimizer)
    return part


def _adam(optimizer: MegatronOptimizer) -> torch.optim.Optimizer:
    """The torch AdamW that Megatron's optimizer steps (over the fp32 main weights in bf16)."""
    adam = _inner(optimizer).optimizer
    assert isinstance(adam, torch.optim.AdamW)
    return adam


def _main(param: torch.Tensor) -> torch.Tensor:
    """The fp32 main weight Megatron's mixed-precision optimizer keeps for a bf16 parameter."""
    main: torch.Tensor = getattr(param, "main_param")  # noqa: B009  # set by Megatron
    return main


def _sft_batch(samples: list[Sample]) -> TrainBatch:
    """Every response token with advantage 1: the policy loss then has the SFT gradient."""
    return TrainBatch(tuple(samples), tuple((1.0,) * len(s.response.token_ids) for s in samples))


def test_bf16_stack_is_megatron_mixed_precision(tiny_hf: Path) -> None:
    stack = _stack(tiny_hf, "bfloat16")
    assert type(_inner(stack.optimizer)).__name__ == "Float16OptimizerWithFloat16Params"
    params = list(stack.gpt.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(getattr(p, "main_grad").dtype == torch.float32 for p in params)  # noqa: B009  # DDP reduces in fp32
    assert all(p.dtype == torch.float32 for g in stack.optimizer.param_groups for p in g["params"])
    assert all(torch.equal(_main(p).bfloat16(), p) for p in params)

    stack.train_step(make_batch(make_samples(8, seed=1), seed=2))
    # The bf16 weights are the rounded fp32 main weights, which keep what bf16 cannot hold.
    assert all(torch.equal(_main(p).bfloat16(), p) for p in params)
    assert any(not torch.equal(_main(p).bfloat16().float(), _main(p)) for p in params)
    # The CPU shim showed CUDA type names to the optimizer's constructor only.
    assert torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16)).type() == "torch.BFloat16Tensor"


def _actor_losses(stack: MegatronTrainingStack) -> list[float]:
    """The SFT loss (mean negative log-prob of the response tokens) after each of 20 steps on one
    batch: the actor's policy loss is 1 by construction at ratio 1, this one moves."""
    samples = make_samples(8, seed=0)
    losses = []
    for _ in range(STEPS):
        stack.train_step(_sft_batch(samples))
        losses.append(-statistics.fmean(lp for row in stack.forward(samples) for lp in row))
    return losses


def _critic_losses(stack: MegatronTrainingStack) -> list[float]:
    batch = make_batch(make_samples(8, seed=0), seed=100, returns=True)
    return [stack.train_step(batch).loss for _ in range(STEPS)]


def test_bf16_training_tracks_fp32(tiny_hf: Path) -> None:
    actor = {p: _actor_losses(_stack(tiny_hf, p)) for p in ("float32", "bfloat16")}
    fp32, bf16 = actor["float32"], actor["bfloat16"]
    assert fp32[0] - fp32[-1] > 1.0  # it learns, far more than the tolerance
    assert bf16 == pytest.approx(fp32, rel=ACTOR_REL_TOL)

    critic = {p: _critic_losses(_stack(tiny_hf, p, "critic")) for p in ("float32", "bfloat16")}
    fp32, bf16 = critic["float32"], critic["bfloat16"]
    assert fp32[0] - fp32[-1] > 5 * CRITIC_ABS_TOL
    assert bf16 == pytest.approx(fp32, abs=CRITIC_ABS_TOL)


def _values(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every element of ``tensors``, sorted: checkpoints stack the layers' tensors and rename some,
    so they are compared as multisets of values."""
    return torch.sort(torch.cat([t.detach().flatten() for t in tensors])).values


def test_checkpoint_holds_fp32_main_weights_and_optimizer_state(
    tiny_hf: Path, tmp_path: Path
) -> None:
    stack = _stack(tiny_hf, "bfloat16")
    for k in range(2):
        stack.train_step(make_batch(make_samples(8, seed=k), seed=10 + k))
    stack.save(tmp_path / "ckpt", rollout_id=1)
    model = dist_checkpointing.load_plain_tensors(str(tmp_path / "ckpt" / "model"))
    optim = dist_checkpointing.load_plain_tensors(str(tmp_path / "ckpt" / "optimizer"))

    def saved(prefix: str) -> list[torch.Tensor]:
        found = [t for k, t in optim.items() if k.startswith(prefix)]
        assert found and all(t.dtype == torch.float32 for t in found), prefix
        return found

    params = list(stack.gpt.parameters())
    mains = [_main(p) for p in params]
    assert all(t.dtype == torch.bfloat16 for t in model.values())
    assert torch.equal(_values(list(model.values())), _values(params))
    assert torch.equal(_values(saved("optimizer.state.fp32_param.")), _values(mains))
    # The saved main weights are fp32 values, not the bf16 weights widened.
    assert not torch.equal(_values(saved("optimizer.state.fp32_param.")), _values(params).float())
    adam = _adam(stack.optimizer)
    for moment in ("exp_avg", "exp_avg_sq"):
        state = [adam.state[m][moment] for m in mains]
        assert torch.equal(_values(saved(f"optimizer.state.{moment}.")), _values(state))


def test_eval_stack_in_bf16_builds_no_optimizer(tiny_hf: Path) -> None:
    samples = make_samples(5, seed=3)
    ev = MegatronBackend().build_eval_stack(
        EvalSpec(ModelSpec("actor", tiny_hf, precision="bfloat16"))
    )
    assert not hasattr(ev, "optimizer") and not hasattr(ev, "scheduler")
    params = list(ev.model.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in params)
    assert not any(hasattr(p, "main_grad") or hasattr(p, "main_param") for p in params)
    fp32 = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
    for x, y in zip(ev.forward(samples), fp32.forward(samples), strict=True):
        assert x == pytest.approx(y, abs=0.05)  # bf16 weights and activations, fp32 log-softmax
    for x, y in zip(ev.forward(samples), _stack(tiny_hf, "bfloat16").forward(samples), strict=True):
        assert x == y  # one forward path for eval and training stacks


@pytest.mark.parametrize("saved_as", ["float32", "bfloat16"])
def test_weights_load_into_either_precision_but_optimizer_state_does_not(
    tiny_hf: Path, tmp_path: Path, saved_as: Precision
) -> None:
    other: Precision = "float32" if saved_as == "bfloat16" else "bfloat16"
    stack = _stack(tiny_hf, saved_as)
    stack.train_step(make_batch(make_samples(8, seed=1), seed=2))
    stack.save(tmp_path / "ckpt", rollout_id=3)
    trained = weights(stack.export_weights())

    ev = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf, precision=other)))
    assert ev.load(tmp_path / "ckpt") == 3
    for name, tensor in weights(ev.export_weights()).items():
        assert torch.equal(tensor, trained[name].to(tensor.dtype)), name

    for precision, distributed in ((other, False), (saved_as, True)):
        with pytest.raises(CheckpointError, match="different optimizer") as info:
            _stack(tiny_hf, precision, distributed=distributed).load(tmp_path / "ckpt")
        assert "--bf16" in str(info.value) and "--use-distributed-optimizer" in str(info.value)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_distributed_optimizer_at_one_rank_matches_the_plain_one(
    tiny_hf: Path, precision: Precision
) -> None:
    batch = make_batch(make_samples(8, seed=1), seed=2)
    plain, sharded = _stack(tiny_hf, precision), _stack(tiny_hf, precision, distributed=True)
    assert type(_inner(sharded.optimizer)).__name__ == "DistributedOptimizer"
    for _ in range(3):
        a, b = plain.train_step(batch), sharded.train_step(batch)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    x, y = weights(plain.export_weights()), weights(sharded.export_weights())
    for name in x:
        torch.testing.assert_close(x[name], y[name], msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_and_exports_in_bf16(
    family: Family, family_models: FamilyModels, tmp_path: Path
) -> None:
    """Precision is plumbing, not family code: each family builds in bf16 under Megatron's
    mixed-precision optimizer (Qwen3-MoE's experts and router too), computes transformers' bf16
    logits up to bf16 rounding, trains, and saves a bf16 HF folder that imports back bit for bit."""
    source = family_models.folder(family)
    stack = MegatronBackend().build_training_stack(train_spec(source, precision="bfloat16"))
    parts = {type(part).__name__ for part in optimizer_parts(stack.optimizer)}
    assert parts == {"Float16OptimizerWithFloat16Params"}
    assert all(p.dtype == torch.bfloat16 for p in stack.gpt.parameters())
    vocab = stack.arch.vocab_size
    tokens = random_tokens(vocab)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = hf(tokens).logits.float()
    stack.gpt.eval()
    got = megatron_logits(stack.gpt, tokens, vocab).float()
    torch.testing.assert_close(got, expected, rtol=0, atol=FAMILY_LOGITS_ATOL)

    stack.gpt.train()
    before = weights(stack.export_weights())
    stack.train_step(make_batch(make_samples(4, seed=3), seed=4))
    exported = weights(stack.export_weights())
    assert all(t.dtype == torch.bfloat16 for t in exported.values())
    assert any(not torch.equal(t, before[name]) for name, t in exported.items())  # trained

    out = tmp_path / "hf"
    stack.save_hf(out)  # what --save-hf calls (rlcore.protocols.stacks.HFExporter)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    arch = read_hf_config(out)
    again = build_gpt(arch, "actor", torch.device("cpu"), precision="bfloat16")
    load_hf_weights(again, out, arch, "actor")
    round_trip = weights(export_hf_weights(again, arch, "actor"))
    assert round_trip.keys() == exported.keys()
    for name, tensor in round_trip.items():
        assert torch.equal(tensor, exported[name]), name
