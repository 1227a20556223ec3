"""Reference decoding with transformers (fp32, CPU): what SGLang must reproduce."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import LlamaForCausalLM


def hf_model(config_folder: str, weights: Mapping[str, torch.Tensor]) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(config_folder, dtype=torch.float32)
    model.load_state_dict(dict(weights))
    model.train(False)
    return model


@torch.no_grad()
def greedy(
    model: LlamaForCausalLM, prompt: Sequence[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, one full forward per step (no cache, no surprises)."""
    ids = list(prompt)
    tokens: list[int] = []
    log_probs: list[float] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(lp))
        tokens.append(token)
        log_probs.append(float(lp[token]))
        ids.append(token)
    return tokens, log_probs


@torch.no_grad()
def score(
    model: LlamaForCausalLM,
    prompt: Sequence[int],
    response: Sequence[int],
    temperature: float = 1.0,
) -> list[float]:
    """Log-probs of ``response`` after ``prompt`` under ``softmax(logits / temperature)``."""
    ids = torch.tensor([list(prompt) + list(response)])
    lp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    start = len(prompt) - 1
    return [float(lp[start + t, token]) for t, token in enumerate(response)]
