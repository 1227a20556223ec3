"""Hypothesis strategies for the algorithm tests: ragged samples, padded float rows, groups."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from rlcore.samples import Generation, Prompt, Sample

VOCAB = 16

finite = st.floats(-5.0, 5.0, allow_nan=False, width=32)
log_prob = st.floats(-8.0, 0.0, allow_nan=False, width=32)


@st.composite
def samples(
    draw: st.DrawFn, min_size: int = 1, max_size: int = 6, max_response: int = 5
) -> list[Sample]:
    """Samples with prompts of 1-4 tokens and responses of 0..max_response tokens."""
    n = draw(st.integers(min_size, max_size))
    out = []
    for i in range(n):
        prompt = tuple(draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=4)))
        response = tuple(draw(st.lists(st.integers(1, VOCAB - 1), max_size=max_response)))
        lps = tuple(draw(st.lists(log_prob, min_size=len(response), max_size=len(response))))
        reward = draw(st.floats(-2.0, 2.0, allow_nan=False))
        out.append(
            Sample(
                prompt=Prompt(index=i, text="", token_ids=prompt),
                response=Generation(token_ids=response, log_probs=lps, text=""),
                reward=reward,
                group=i,
            )
        )
    return out


@st.composite
def grouped_samples(
    draw: st.DrawFn, max_groups: int = 4, max_group_size: int = 5
) -> tuple[list[Sample], int]:
    """Consecutive groups of samples sharing a group id, and the group size."""
    group_size = draw(st.integers(1, max_group_size))
    n_groups = draw(st.integers(1, max_groups))
    flat = draw(samples(min_size=group_size * n_groups, max_size=group_size * n_groups))
    regrouped = [
        Sample(prompt=s.prompt, response=s.response, reward=s.reward, group=i // group_size)
        for i, s in enumerate(flat)
    ]
    return regrouped, group_size


def rows_for(
    data: st.DataObject, batch: list[Sample], elements: st.SearchStrategy[float] = finite
) -> tuple[tuple[float, ...], ...]:
    """One float row per sample, as long as its response."""
    lengths = [len(s.response.token_ids) for s in batch]
    return tuple(tuple(data.draw(st.lists(elements, min_size=n, max_size=n))) for n in lengths)


@st.composite
def masked_floats(
    draw: st.DrawFn, max_b: int = 5, max_t: int = 6
) -> tuple[torch.Tensor, torch.Tensor]:
    """A float64 ``[B, T]`` tensor and a right-padded mask with at least one True per row."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    lengths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
    values = draw(st.lists(finite, min_size=b * t, max_size=b * t))
    x = torch.tensor(values, dtype=torch.float64).reshape(b, t)
    mask = torch.tensor([[j < n for j in range(t)] for n in lengths])
    return x, mask
