"""The rollout temperature on the Megatron backend: every policy stack scores ``softmax(logits /
T)``, the distribution the engine sampled from, so the engine's and the trainer's log-probs of the
same tokens agree at ``T != 1`` and the loss differentiates the policy that acted (issue #34)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.engines.embedded import EmbeddedEngine
from rlcore.samples import Prompt, Sample, SamplingParams, TrainBatch
from rlcore.specs import EvalSpec, LossSpec, Role
from rlcore.testing.tiny import build_char_tokenizer
from rlcore_megatron.backend import MegatronBackend
from tests.megatron.helpers import make_samples, train_spec

pytestmark = pytest.mark.megatron

T = 0.7


@torch.no_grad()
def _hf_scores(
    folder: Path, samples: Sequence[Sample], temperature: float
) -> tuple[list[list[float]], list[list[float]]]:
    """transformers' log-probs of each response token under ``softmax(logits / temperature)``,
    and the entropies of those distributions, from one full forward per sample."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    log_probs, entropies = [], []
    for s in samples:
        ids = torch.tensor([[*s.prompt.token_ids, *s.response.token_ids]])
        n = len(s.prompt.token_ids)
        rows = torch.log_softmax(model(ids).logits[0, n - 1 : -1].float() / temperature, dim=-1)
        picked = rows.gather(-1, torch.tensor(s.response.token_ids).unsqueeze(-1)).squeeze(-1)
        log_probs.append(picked.tolist())
        entropies.append((-(rows.exp() * rows).sum(dim=-1)).tolist())
    return log_probs, entropies


def _close(got: Sequence[Sequence[float]], want: Sequence[Sequence[float]], tol: float) -> bool:
    return all(
        len(g) == len(w) and all(abs(x - y) <= tol for x, y in zip(g, w, strict=True))
        for g, w in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("role", ["actor", "reference", "teacher"])
def test_every_policy_stack_scores_logits_divided_by_the_temperature(
    tiny_hf: Path, role: Role
) -> None:
    """An eval stack of each policy role, and the training stack, give ``log_softmax(logits /
    T)`` at the sampled tokens: transformers' tempered log-probs, not its untempered ones."""
    samples = make_samples(6, seed=11)
    tempered, _ = _hf_scores(tiny_hf, samples, T)
    untempered, _ = _hf_scores(tiny_hf, samples, 1.0)
    spec = train_spec(tiny_hf, role)
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, temperature=T))
    stack = MegatronBackend().build_eval_stack(EvalSpec(spec.model))
    got = stack.forward(samples)
    assert _close(got, tempered, 1e-5)
    assert not _close(got, untempered, 1e-3)
    if role == "actor":
        trained = MegatronBackend().build_training_stack(spec).forward(samples)
        assert _close(trained, tempered, 1e-5)


def test_the_train_step_differentiates_the_tempered_policy(tiny_hf: Path) -> None:
    """With old log-probs of the tempered policy the first step's ratio is exactly 1 (nothing
    clipped, no KL between old and new), and the entropy it reports is the tempered
    distribution's."""
    samples = make_samples(4, seed=2)
    tempered, entropies = _hf_scores(tiny_hf, samples, T)
    spec = train_spec(tiny_hf, loss=LossSpec(eps_clip=0.0, entropy_coef=1e-3))
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, temperature=T))
    stack = MegatronBackend().build_training_stack(spec)
    old = tuple(tuple(row) for row in stack.forward(samples))
    assert _close(old, tempered, 1e-5)
    batch = TrainBatch(
        samples=tuple(samples),
        advantages=tuple((1.0,) * len(s.response.token_ids) for s in samples),
        old_log_probs=old,
    )
    metrics = stack.train_step(batch)
    assert metrics.extra["clipfrac"] == 0.0 and abs(metrics.extra["approx_kl"]) < 1e-10
    per_sequence = [sum(row) / len(row) for row in entropies]  # seq-mean-token-mean
    assert metrics.extra["entropy"] == pytest.approx(sum(per_sequence) / len(samples), abs=1e-5)


def test_the_engine_and_the_trainer_agree_at_a_temperature(tiny_hf: Path, tmp_path: Path) -> None:
    """The embedded engine samples at T = 0.7 with top-k; the Megatron actor scoring the same
    tokens at that temperature gives the engine's log-probs (fp32: within 1e-5), and the train
    step's mismatch metric says so."""
    folder = tmp_path / "model"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_hf), dtype=torch.float32)
    model.save_pretrained(str(folder))
    build_char_tokenizer(folder, "".join(chr(c) for c in range(33, 33 + 29)))
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(str(folder)))
    engine = EmbeddedEngine.from_pretrained(folder, tokenizer, seed=3)
    prompts = [Prompt(i, "", (1, 3 + i, 5 + 2 * i)) for i in range(4)]
    params = SamplingParams(max_new_tokens=6, temperature=T, top_k=8, ignore_eos=True)
    requests = prompts * 2
    generations = engine.generate(requests, params)
    engine.close()
    samples = [
        Sample(p, g, 0.0, i) for i, (p, g) in enumerate(zip(requests, generations, strict=True))
    ]
    spec = train_spec(folder, global_batch_size=8, micro_batch_size=4)
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, temperature=T))
    stack = MegatronBackend().build_training_stack(spec)
    assert _close(stack.forward(samples), [g.log_probs for g in generations], 1e-5)
    batch = TrainBatch(
        samples=tuple(samples),
        advantages=tuple((0.5,) * len(g.token_ids) for g in generations),
        rollout_log_probs=tuple(g.log_probs for g in generations),
    )
    metrics = stack.train_step(batch)
    assert metrics.extra["logprob_mismatch"] <= 1e-5
