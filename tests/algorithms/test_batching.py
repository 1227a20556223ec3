"""Padding samples into tensors, and reading per-response-token quantities off model outputs."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rlcore.algorithms.batching import (
    TensorBatch,
    entropy_from_logits,
    gather_response,
    tensorize,
    tensorize_samples,
    token_log_probs,
    unpad,
)
from rlcore.samples import Generation, Prompt, Sample, TrainBatch
from tests.strategies import VOCAB, rows_for, samples

PAD = 0


def make_sample(prompt: tuple[int, ...], response: tuple[int, ...], reward: float = 0.0) -> Sample:
    return Sample(
        prompt=Prompt(index=0, text="", token_ids=prompt),
        response=Generation(token_ids=response, log_probs=tuple(-0.5 for _ in response), text=""),
        reward=reward,
        group=0,
    )


def two_samples() -> list[Sample]:
    # Prompt lengths 3 and 1, response lengths 2 and 3: S = max(5, 4) = 5, T = 3.
    return [make_sample((1, 2, 3), (4, 5)), make_sample((1,), (6, 7, 8))]


def test_tensorize_samples_pads_right_and_indexes_the_predicting_logits() -> None:
    batch = tensorize_samples(two_samples(), pad_id=PAD)

    assert batch.tokens.tolist() == [[1, 2, 3, 4, 5], [1, 6, 7, 8, PAD]]
    assert batch.attention_mask.tolist() == [[True] * 5, [True] * 4 + [False]]
    # Sample 0: response tokens at positions 3, 4 are predicted by logits at 2, 3; padding at 4
    # (P + j - 1 = 3 + 2 - 1 = 4, still a valid index). Sample 1: positions 1, 2, 3 <- 0, 1, 2.
    assert batch.response_index.tolist() == [[2, 3, 4], [0, 1, 2]]
    assert batch.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert batch.advantages.tolist() == [[0.0] * 3, [0.0] * 3]
    assert batch.advantages.dtype == torch.float32
    assert batch.returns is None and batch.old_log_probs is None
    assert batch.ref_log_probs is None and batch.old_values is None
    assert batch.num_sequences == 2


def test_padding_entries_of_response_index_are_clamped_into_the_sequence() -> None:
    # Sample 1's padding would point at 2 + 3 - 1 = 4 and beyond; S = 4, so clamp to 3.
    batch = tensorize_samples([make_sample((1,), (5, 6, 7, 8)), make_sample((1, 2), (9,))], PAD)
    assert batch.tokens.shape == (2, 5)
    assert batch.response_index.tolist() == [[0, 1, 2, 3], [1, 2, 3, 4]]
    batch = tensorize_samples([make_sample((1,), (5, 6, 7)), make_sample((1, 2, 3), ())], PAD)
    assert batch.tokens.shape == (2, 4)
    assert batch.response_index.tolist() == [[0, 1, 2], [2, 3, 3]]
    assert batch.response_mask.tolist() == [[True] * 3, [False] * 3]


def test_tensorize_carries_the_optional_fields_only_when_present() -> None:
    s = two_samples()
    train = TrainBatch(
        samples=tuple(s),
        advantages=((1.0, 2.0), (3.0, 4.0, 5.0)),
        old_log_probs=((-1.0, -2.0), (-3.0, -4.0, -5.0)),
    )
    batch = tensorize(train, pad_id=PAD)
    assert batch.advantages.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]
    assert batch.old_log_probs is not None
    assert batch.old_log_probs.tolist() == [[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]
    assert batch.returns is None and batch.ref_log_probs is None and batch.old_values is None


def test_select_keeps_the_padded_widths() -> None:
    train = TrainBatch(
        samples=tuple(two_samples()),
        advantages=((1.0, 2.0), (3.0, 4.0, 5.0)),
        returns=((0.5, 0.5), (1.0, 1.0, 1.0)),
    )
    batch = tensorize(train, PAD)
    first = batch.select(slice(0, 1))
    assert first.tokens.shape == (1, 5) and first.advantages.shape == (1, 3)
    assert first.advantages.tolist() == [[1.0, 2.0, 0.0]]
    assert first.returns is not None and first.returns.tolist() == [[0.5, 0.5, 0.0]]
    assert first.old_log_probs is None
    second = batch.select(torch.tensor([1]))
    assert second.tokens.tolist() == [[1, 6, 7, 8, PAD]]
    assert second.num_sequences == 1


def test_empty_batch_and_empty_responses() -> None:
    empty = tensorize_samples([], PAD)
    assert empty.tokens.shape == (0, 0) and empty.response_mask.shape == (0, 0)
    assert unpad(empty.advantages, empty) == []
    no_response = tensorize_samples([make_sample((1, 2), ())], PAD)
    assert no_response.response_mask.shape == (1, 0)
    logits = torch.randn(1, 2, VOCAB)
    assert token_log_probs(logits, no_response).shape == (1, 0)
    assert unpad(token_log_probs(logits, no_response), no_response) == [()]


def test_a_response_without_a_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="sample 1 has an empty prompt"):
        tensorize_samples([make_sample((1,), (2,)), make_sample((), (3,))], PAD)


def test_token_log_probs_by_hand() -> None:
    # One sample, prompt (1,), response (2,): logits at position 0 predict token 2.
    batch = tensorize_samples([make_sample((1,), (2,))], PAD)
    logits = torch.zeros(1, 2, 4)
    logits[0, 0] = torch.tensor([0.0, 0.0, math.log(2.0), 0.0])  # softmax: 1/5, 1/5, 2/5, 1/5
    logits[0, 1] = torch.tensor([100.0, 0.0, 0.0, 0.0])  # must not be read
    got = token_log_probs(logits, batch)
    assert got.shape == (1, 1)
    assert got.item() == pytest.approx(math.log(2.0 / 5.0), rel=1e-6)


def naive_log_probs(
    logits: torch.Tensor, batch_samples: list[Sample], temperature: float = 1.0
) -> list[list[float]]:
    full = torch.log_softmax(logits.double() / temperature, dim=-1).tolist()
    out = []
    for i, s in enumerate(batch_samples):
        p = len(s.prompt.token_ids)
        out.append([full[i][p + j - 1][tok] for j, tok in enumerate(s.response.token_ids)])
    return out


TEMPERATURES = st.sampled_from([1.0, 0.0, 0.7, 1.3]) | st.floats(0.25, 4.0)


@given(samples(), st.integers(0, 2**31 - 1), TEMPERATURES)
def test_token_log_probs_equals_a_full_log_softmax_gather(
    batch_samples: list[Sample], seed: int, temperature: float
) -> None:
    """``log_softmax(logits / T)`` at the response tokens, the rollout's temperature ``T`` (0,
    greedy, scores at 1)."""
    batch = tensorize_samples(batch_samples, PAD)
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(batch.num_sequences, batch.tokens.shape[1], VOCAB, generator=gen)
    got = token_log_probs(logits, batch, temperature)
    assert got.shape == batch.response_mask.shape
    assert torch.all(got[~batch.response_mask] == 0)
    want = naive_log_probs(logits, batch_samples, temperature or 1.0)
    for row, expected in zip(unpad(got, batch), want, strict=True):
        assert row == pytest.approx(expected, abs=1e-5)


@given(samples(), st.integers(0, 2**31 - 1), TEMPERATURES)
def test_logits_at_the_response_give_the_same_log_probs_and_entropy(
    batch_samples: list[Sample], seed: int, temperature: float
) -> None:
    """``at_response``: logits ``[B, T, V]`` already at ``response_index`` (a model's head run
    there only) read exactly as the ``[B, S, V]`` logits they are rows of."""
    batch = tensorize_samples(batch_samples, PAD)
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(batch.num_sequences, batch.tokens.shape[1], VOCAB, generator=gen)
    index = batch.response_index.unsqueeze(-1).expand(-1, -1, VOCAB)
    rows = logits.gather(1, index)
    for read in (token_log_probs, entropy_from_logits):
        got = read(rows, batch, temperature, at_response=True)
        assert torch.equal(got, read(logits, batch, temperature))


def test_logits_at_the_response_must_have_its_shape() -> None:
    batch = tensorize_samples(two_samples(), PAD)
    with pytest.raises(ValueError, match="logits at the response positions have shape"):
        token_log_probs(torch.randn(2, 5, VOCAB), batch, at_response=True)


def test_token_log_probs_is_differentiable_and_upcasts_half_precision() -> None:
    batch = tensorize_samples(two_samples(), PAD)
    logits = torch.randn(2, 5, VOCAB, requires_grad=True)
    (grad,) = torch.autograd.grad(token_log_probs(logits, batch).sum(), logits)
    # Only predicting rows get gradient: sample 0 reads positions 2, 3; sample 1 reads 0, 1, 2.
    assert torch.all(grad[0, :2] == 0) and torch.all(grad[0, 4] == 0)
    assert torch.all(grad[1, 3:] == 0)
    assert torch.all(grad[0, 2:4].abs().sum(-1) > 0) and torch.all(grad[1, :3].abs().sum(-1) > 0)
    half = token_log_probs(logits.detach().bfloat16(), batch)
    assert half.dtype == torch.float32


@given(samples(), st.integers(0, 2**31 - 1), TEMPERATURES)
def test_entropy_matches_the_definition(
    batch_samples: list[Sample], seed: int, temperature: float
) -> None:
    """The entropy of ``softmax(logits / T)``, the distribution that sampled each token."""
    batch = tensorize_samples(batch_samples, PAD)
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch.num_sequences, batch.tokens.shape[1], VOCAB, generator=gen)
    got = unpad(entropy_from_logits(logits, batch, temperature), batch)
    probs = torch.softmax(logits.double() / (temperature or 1.0), dim=-1)
    full = (-(probs * probs.log()).sum(-1)).tolist()
    for i, s in enumerate(batch_samples):
        p = len(s.prompt.token_ids)
        want = [full[i][p + j - 1] for j in range(len(s.response.token_ids))]
        assert got[i] == pytest.approx(want, abs=1e-5)


def test_entropy_by_hand() -> None:
    batch = tensorize_samples([make_sample((1,), (2,))], PAD)
    logits = torch.zeros(1, 2, 4)  # uniform over 4 tokens: entropy log 4
    assert entropy_from_logits(logits, batch).item() == pytest.approx(math.log(4.0))


def test_gather_response_reads_the_value_before_each_token() -> None:
    batch = tensorize_samples(two_samples(), PAD)
    values = torch.arange(10, dtype=torch.float32).reshape(2, 5)  # value = 5 * row + position
    # Sample 0 reads positions 2, 3 (then padding -> 0); sample 1 reads 0, 1, 2 -> 5, 6, 7.
    assert gather_response(values, batch).tolist() == [[2.0, 3.0, 0.0], [5.0, 6.0, 7.0]]


@given(st.data(), samples())
def test_tensorize_then_unpad_round_trips(data: st.DataObject, batch_samples: list[Sample]) -> None:
    advantages = rows_for(data, batch_samples)
    returns = rows_for(data, batch_samples)
    train = TrainBatch(samples=tuple(batch_samples), advantages=advantages, returns=returns)
    batch = tensorize(train, PAD)
    assert isinstance(batch, TensorBatch)
    # The inputs are float32-representable, so the trip through float32 is exact.
    assert tuple(unpad(batch.advantages, batch)) == advantages
    assert batch.returns is not None
    assert tuple(unpad(batch.returns, batch)) == returns
    assert torch.all(batch.advantages[~batch.response_mask] == 0)
    # Tokens: each row is prompt + response, then padding.
    for row, mask, s in zip(
        batch.tokens.tolist(), batch.attention_mask.tolist(), batch_samples, strict=True
    ):
        n = len(s.prompt.token_ids) + len(s.response.token_ids)
        assert tuple(row[:n]) == s.prompt.token_ids + s.response.token_ids
        assert all(t == PAD for t in row[n:])
        assert mask == [k < n for k in range(len(row))]
    # Every response index is valid, and on real tokens it points one before the token.
    s_len = batch.tokens.shape[1]
    assert bool(torch.all((batch.response_index >= 0) & (batch.response_index < max(s_len, 1))))
    targets = batch.tokens.gather(1, (batch.response_index + 1).clamp(max=max(s_len - 1, 0)))
    for i, s in enumerate(batch_samples):
        n = len(s.response.token_ids)
        assert tuple(targets[i, :n].tolist()) == s.response.token_ids


def test_tensor_batch_refuses_mismatched_shapes() -> None:
    batch = tensorize_samples(two_samples(), PAD)  # S = 5, T = 3
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 2\), response_index \(2, 3\)"):
        attrs.evolve(batch, advantages=torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 4\), tokens \(2, 5\)"):
        attrs.evolve(batch, attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"response_index has shape \(1, 3\), expected \(2, T\)"):
        attrs.evolve(batch, response_index=torch.zeros(1, 3, dtype=torch.long))
