"""The FSDP backend runs a policy's output head on the positions that predict response tokens
only (``logits_to_keep``, issue #36): the log-probs and their gradients are those of the full
``[B, S, V]`` logits, for the families' quirks (final logit soft-capping, tied embeddings, a
sampling temperature, LoRA), and the head never produces logits at the other positions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from rlcore.algorithms.batching import TensorBatch, tensorize_samples, token_log_probs
from rlcore.samples import TrainBatch
from rlcore_fsdp.backend import FSDPBackend
from rlcore_fsdp.options import FSDPOptions
from rlcore_fsdp.stacks import model_output
from tests.fsdp.test_families import CONFIGS, TEMPERATURE, VOCAB
from tests.megatron.helpers import make_samples, train_spec

# peft asks transformers for a property this transformers version deprecates (loading the folder)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

# soft-capping and tied embeddings; absolute positions and tied; untied
FAMILIES = ("gemma2", "gpt2", "mistral")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rlcore.new_model import write_model

    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        write_model(folder, CONFIGS[family]().to_dict(), seed=3)
        out[family] = folder
    return out


def _head(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose output is the logits (the output embedding), under peft too."""
    base: Any = getattr(model, "get_base_model", lambda: model)()
    head = base.get_output_embeddings()
    assert isinstance(head, torch.nn.Module)
    return head


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = grad.clone()
    return out


def _full_logits(model: torch.nn.Module, tb: TensorBatch) -> torch.Tensor:
    out = model(input_ids=tb.tokens, attention_mask=tb.attention_mask, use_cache=False)
    logits: torch.Tensor = out.logits.float()
    return logits


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_response_logits_equal_the_full_logits_with_their_gradients(
    family: str, lora_rank: int, models: dict[str, Path]
) -> None:
    spec = train_spec(models[family], global_batch_size=4, micro_batch_size=4)
    backend = FSDPBackend(FSDPOptions(lora_rank=lora_rank, lora_alpha=8))
    stack = backend.build_training_stack(spec)
    model = stack.model
    tb = tensorize_samples(make_samples(5, seed=4, vocab=VOCAB), 0)
    assert tb.response_index.shape[1] < tb.tokens.shape[1]

    shapes: list[tuple[int, ...]] = []
    hook = _head(model).register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.shape)))
    try:
        rows = model_output(model, tb, is_critic=False)
    finally:
        hook.remove()
    # the head ran once, on the B x T predicting positions, never on the B x S sequence
    assert shapes == [(*tb.response_index.shape, VOCAB)]
    ours = token_log_probs(rows, tb, TEMPERATURE, at_response=True)
    torch.autograd.backward(ours.sum())
    ours_grads = _gradients(model)
    model.zero_grad(set_to_none=True)

    theirs = token_log_probs(_full_logits(model, tb), tb, TEMPERATURE)
    torch.autograd.backward(theirs.sum())
    theirs_grads = _gradients(model)
    model.zero_grad(set_to_none=True)

    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-5)
    assert ours_grads.keys() == theirs_grads.keys() and ours_grads
    for name, grad in ours_grads.items():
        torch.testing.assert_close(grad, theirs_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_train_step_and_scoring_never_run_the_head_on_the_whole_sequence(
    models: dict[str, Path],
) -> None:
    samples = make_samples(4, seed=5, vocab=VOCAB)
    stack = FSDPBackend().build_training_stack(
        train_spec(models["gemma2"], global_batch_size=4, micro_batch_size=2)
    )
    positions: list[int] = []

    def record(_m: Any, _i: Any, out: torch.Tensor) -> None:
        positions.append(out.shape[1])

    hook = _head(stack.model).register_forward_hook(record)
    try:
        old = stack.forward(samples)
        advantages = tuple(tuple(1.0 for _ in s.response.token_ids) for s in samples)
        stack.train_step(TrainBatch(tuple(samples), advantages, old_log_probs=tuple(old)))
    finally:
        hook.remove()
    longest_response = max(len(s.response.token_ids) for s in samples)
    assert positions and max(positions) <= longest_response
