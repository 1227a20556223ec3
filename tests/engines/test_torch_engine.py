"""TorchEngine: sampling from any torch module that maps token ids to next-token logits."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from torch import nn

from rlcore.algorithms import tensorize_samples, token_log_probs, unpad
from rlcore.engines.torch_engine import TorchEngine
from rlcore.errors import RolloutError
from rlcore.samples import Prompt, Sample, SamplingParams
from rlcore.weights import deliver

VOCAB = 12
EOS = 2


class CharTokenizer:
    """Token ``i`` is the letter ``chr(ord('a') + i)``; 0 pads, 2 ends."""

    pad_token_id = 0
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids if t not in (0, EOS))


class Gru(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        out: torch.Tensor = self.head(hidden)
        return out


def _prompts() -> list[Prompt]:
    texts = ["dd", "efg", "d", "hij", "ef", "dd"]
    return [Prompt(i, t, tuple(CharTokenizer().encode(t))) for i, t in enumerate(texts)]


def test_one_generation_per_prompt_in_order_with_the_trainers_log_probs() -> None:
    model = Gru(0)
    engine = TorchEngine(Gru(1), CharTokenizer(), seed=3)
    with engine.receive_weights(5) as sinks:
        deliver(model.state_dict().items(), sinks)
    prompts = _prompts()
    generations = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    assert len(generations) == len(prompts)
    assert all(g.weight_version == 5 for g in generations)
    for g in generations:
        assert 1 <= len(g.token_ids) <= 6
        assert (g.finish_reason == "stop") == (g.token_ids[-1] == EOS)
        assert EOS not in g.token_ids[:-1]  # a response ends at its first stop token
        assert g.text == CharTokenizer().decode(g.token_ids)
    # The engine's log-probs are the trained model's, scored as a training stack scores them.
    samples = [
        Sample(p, g, 0.0, i) for i, (p, g) in enumerate(zip(prompts, generations, strict=True))
    ]
    batch = tensorize_samples(samples, pad_id=0)
    with torch.no_grad():
        rows = unpad(token_log_probs(model(batch.tokens), batch), batch)
    # Right-padded rows: each row's own tokens are scored exactly as the engine saw them.
    for row, g in zip(rows, generations, strict=True):
        assert row == pytest.approx(g.log_probs, abs=1e-5)


def test_the_same_seed_gives_the_same_samples_and_greedy_is_argmax() -> None:
    def sample(seed: int, temperature: float) -> list[tuple[int, ...]]:
        engine = TorchEngine(Gru(0), CharTokenizer(), seed=seed)
        params = SamplingParams(max_new_tokens=5, temperature=temperature)
        return [g.token_ids for g in engine.generate(_prompts(), params)]

    assert sample(1, 1.0) == sample(1, 1.0)
    assert sample(1, 1.0) != sample(2, 1.0)
    assert sample(1, 0.0) == sample(2, 0.0)
    model = Gru(0)
    with torch.no_grad():
        first = model(torch.tensor([[3, 3]]))[0, -1].argmax().item()
    assert sample(9, 0.0)[0][0] == first


def test_bad_weights_change_nothing_and_a_bad_model_is_named() -> None:
    engine = TorchEngine(Gru(0), CharTokenizer())
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.raises(RolloutError, match=r"unknown weight 'nope'.*'head.bias' has shape \(3,\)"):
        with engine.receive_weights(1) as sinks:
            deliver([("nope", torch.zeros(1)), ("head.bias", torch.zeros(3))], sinks)
    assert engine.weight_version == 0
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in before.items())

    class Flat(nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.zeros(tokens.shape[0], VOCAB) + self.w

        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(VOCAB))

    with pytest.raises(RolloutError, match=r"it must return logits Tensor\[B, T, V\]"):
        TorchEngine(Flat(), CharTokenizer()).generate(_prompts()[:1], SamplingParams(2))
