"""``--bf16`` with the FSDP backend: FSDP2's mixed-precision policy computes in bf16 over fp32
weights. Its log-probs are those of transformers' own bf16 model on the same padded batch (to 1e-5);
training keeps the weights and AdamW's state in fp32 (so its checkpoint resumes in fp32 too) and
lowers the loss; the engines and ``--save-hf`` get the bf16 weights."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
import transformers

from rlcore.samples import Sample, TrainBatch
from rlcore.specs import EvalSpec, ModelSpec
from rlcore_fsdp.backend import FSDPBackend
from rlcore_fsdp.stacks import export_weights
from tests.megatron.helpers import make_samples, train_spec, weights

VOCAB = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rlcore.new_model import write_model

    configs = {
        "gpt2": transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64
        ),
        "mistral": transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        ),
    }  # fmt: skip
    out = {}
    for family, config in configs.items():
        out[family] = tmp_path_factory.mktemp(family)
        write_model(out[family], config.to_dict(), seed=4)
    return out


def _bf16_log_probs(folder: Path, samples: list[Sample]) -> list[list[float]]:
    """transformers' own bf16 model on the samples as one right-padded batch with an attention
    mask (as the stack pads them), its logits read in fp32. The same batch, not each sample
    alone: bf16 attention over a masked batch and over one unpadded sample round differently on
    some CPUs (4e-4 apart on an AVX2-only one, in transformers itself), and equal on others."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    sequences = [[*s.prompt.token_ids, *s.response.token_ids] for s in samples]
    width = max(map(len, sequences))
    ids = torch.tensor([seq + [0] * (width - len(seq)) for seq in sequences])
    mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in sequences])
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits.float()
    rows = []
    for row, s in zip(logits, samples, strict=True):
        start, response = len(s.prompt.token_ids) - 1, s.response.token_ids
        lp = torch.log_softmax(row[start : start + len(response)], dim=-1)
        rows.append(lp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist())
    return rows


@pytest.mark.parametrize("family", ["gpt2", "mistral"])
def test_bf16_log_probs_are_transformers_bf16_ones(family: str, models: dict[str, Path]) -> None:
    samples = make_samples(4, seed=1, vocab=VOCAB)
    spec = ModelSpec("actor", models[family], precision="bfloat16")
    ours = FSDPBackend().build_eval_stack(EvalSpec(spec)).forward(samples)
    fp32 = FSDPBackend().build_eval_stack(EvalSpec(attrs.evolve(spec, precision="float32")))
    exact = fp32.forward(samples)
    theirs = _bf16_log_probs(models[family], samples)
    # The same bf16 computation (measured 2.4e-7 apart: fp32 rounding), 1e-3 away from fp32's.
    for row, expected, full in zip(ours, theirs, exact, strict=True):
        torch.testing.assert_close(torch.tensor(row), torch.tensor(expected), rtol=0, atol=1e-5)
        assert row != full


def test_bf16_training_keeps_fp32_weights_and_exports_bf16(
    models: dict[str, Path], tmp_path: Path
) -> None:
    samples = make_samples(4, seed=2, vocab=VOCAB)
    spec = train_spec(models["mistral"], global_batch_size=4, micro_batch_size=2)
    spec = attrs.evolve(spec, model=attrs.evolve(spec.model, precision="bfloat16"))
    stack = FSDPBackend().build_training_stack(spec)
    before = stack.forward(samples)
    batch = TrainBatch(
        samples=tuple(samples),
        advantages=tuple(tuple(1.0 for _ in s.response.token_ids) for s in samples),
        old_log_probs=tuple(before),
    )
    first, second = stack.train_step(batch), stack.train_step(batch)
    assert second.loss < first.loss
    assert all(p.dtype == torch.float32 for p in stack.model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in stack.optimizer.state.values() if s)
    sent = weights(stack.export_weights())
    assert {t.dtype for t in sent.values()} == {torch.bfloat16}
    stack.save_hf(tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.dtype == torch.bfloat16
    state = loaded.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in sent.items())

    # The checkpoint holds the fp32 weights and AdamW state: training resumes in fp32 as well.
    stack.save(tmp_path / "ckpt", rollout_id=2)
    fp32_spec = attrs.evolve(spec, model=attrs.evolve(spec.model, precision="float32"))
    fp32 = FSDPBackend().build_training_stack(fp32_spec)
    assert fp32.load(tmp_path / "ckpt") == 2
    masters = weights(export_weights(stack.model, "float32"))
    resumed = weights(export_weights(fp32.model, "float32"))
    assert all(torch.equal(resumed[name], tensor) for name, tensor in masters.items())
    assert len(fp32.optimizer.state) == len(stack.optimizer.state) > 0
