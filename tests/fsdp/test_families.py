"""The FSDP backend on model families the Megatron backend does not map, each a tiny random
model built here from its transformers config class: its log-probs are transformers' own
(fp32, <= 1e-5, at a sampling temperature), one step on a batch raises the log-probs of tokens
with a positive advantage, and a critic (a one-label token classifier over the same backbone)
trains. Llama, which both backends build, starts with the same log-probs in both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from rlcore.samples import Sample, TrainBatch
from rlcore.specs import EvalSpec, ModelSpec
from rlcore_fsdp.backend import FSDPBackend
from tests.megatron.helpers import make_samples, train_spec

VOCAB = 40
TEMPERATURE = 0.7

CONFIGS: dict[str, Any] = {
    # absolute positions, tied embeddings
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
        eos_token_id=2,
    ),
    # grouped-query attention, sliding window narrower than the samples
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=4,
    ),
    # logit soft-capping (attention and final), alternating sliding-window layers, tied
    "gemma2": lambda: transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        sliding_window=4, final_logit_softcapping=5.0, attn_logit_softcapping=10.0,
        pad_token_id=0,
    ),
    # fused QKV and gate-up projections
    "phi3": lambda: transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
    # norms after attention and MLP, QK-norm
    "olmo2": lambda: transformers.Olmo2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rlcore.new_model import write_model

    out = {}
    for family, config in CONFIGS.items():
        folder = tmp_path_factory.mktemp(family)
        write_model(folder, config().to_dict(), seed=3)
        out[family] = folder
    return out


def transformers_log_probs(folder: Path, samples: list[Sample]) -> list[list[float]]:
    """Each sample's response log-probs from transformers' own forward on the sample alone."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = []
    with torch.no_grad():
        for s in samples:
            prompt, response = s.prompt.token_ids, s.response.token_ids
            tokens = torch.tensor([[*prompt, *response]])
            logits = model(tokens).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
            lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])
            rows.append(lp[:, 0].tolist())
    return rows


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_log_probs_equal_transformers(family: str, models: dict[str, Path]) -> None:
    samples = make_samples(6, seed=1, vocab=VOCAB)
    spec = ModelSpec("actor", models[family], temperature=TEMPERATURE)
    stack = FSDPBackend().build_eval_stack(EvalSpec(spec))
    ours = stack.forward(samples)  # one padded batch of ragged samples
    theirs = transformers_log_probs(models[family], samples)
    for row, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(row), torch.tensor(expected), rtol=0, atol=1e-5)


def _rewarded(samples: list[Sample], old: list[tuple[float, ...]]) -> TrainBatch:
    return TrainBatch(
        samples=tuple(samples),
        advantages=tuple(tuple(1.0 for _ in s.response.token_ids) for s in samples),
        old_log_probs=tuple(old),
    )


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_one_step_lowers_the_loss(family: str, models: dict[str, Path]) -> None:
    """Every response token has advantage +1: one step raises their log-probs, so the policy
    loss of the same batch against the same old policy (the next step reports it before it
    updates) is lower."""
    samples = make_samples(4, seed=2, vocab=VOCAB)
    stack = FSDPBackend().build_training_stack(
        train_spec(models[family], global_batch_size=4, micro_batch_size=2)
    )
    before = stack.forward(samples)
    first = stack.train_step(_rewarded(samples, before))
    after = stack.forward(samples)
    second = stack.train_step(_rewarded(samples, before))
    assert second.loss < first.loss
    assert sum(map(sum, after)) > sum(map(sum, before))
    assert first.grad_norm > 0 and first.tokens == sum(len(s.response.token_ids) for s in samples)


def test_a_critic_is_a_value_head_on_the_backbone(models: dict[str, Path]) -> None:
    """A critic scores one value per response token and trains toward the returns."""
    samples = make_samples(4, seed=3, vocab=VOCAB)
    spec = train_spec(models["mistral"], "critic", global_batch_size=4, micro_batch_size=4)
    stack = FSDPBackend().build_training_stack(spec)
    values = stack.forward(samples)
    assert [len(v) for v in values] == [len(s.response.token_ids) for s in samples]
    returns = tuple(tuple(1.0 for _ in s.response.token_ids) for s in samples)
    batch = TrainBatch(
        samples=tuple(samples), advantages=returns, returns=returns, old_values=tuple(values)
    )
    first = stack.train_step(batch)
    second = stack.train_step(batch)
    assert second.loss < first.loss
