"""The CPU decode-attention kernel (rlcore.engines.decode_attention) and the blocked key layout it
reads: against a float64 reference on random shapes, in the attention function transformers
calls, and what happens where it cannot be built or does not apply."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.engines import decode_attention
from rlcore.engines.decode_attention import Kernel, decode_attention_forward, load_kernel
from rlcore.engines.embedded import EmbeddedEngine
from rlcore.engines.kv_cache import KEY_BLOCK, PreallocatedLayer, unblock_keys
from rlcore.errors import RolloutError
from rlcore.samples import Prompt, SamplingParams
from rlcore.testing.tiny import build_char_tokenizer, build_tiny_llama


@pytest.fixture(scope="module")
def kernel() -> Kernel:
    built = load_kernel()
    assert built is not None, "the decode kernel did not build here: see the logged warning"
    return built


def reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention in float64: ``q [B, H, 1, D]``, ``keys``/``values [B, KVH, L, D]``, ``mask [B, L]``
    -> ``[B, 1, H, D]``."""
    groups = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(groups, dim=1)
    v = values.double().repeat_interleave(groups, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale  # [B, H, 1, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@st.composite
def attention_inputs(
    draw: st.DrawFn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float]:
    """Random decode-step inputs as the engine hands them over: the query a transposed view, the
    values a prefix of a larger buffer, the keys written into a blocked buffer whose unwritten
    positions hold NaN."""
    batch, kv_heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    groups = draw(st.integers(1, 4))
    dim = draw(st.sampled_from([1, 3, 8, 16, 40, 64, 128]))  # 64 and 128 have their own loops
    length = draw(st.integers(1, 3 * KEY_BLOCK + 5))
    capacity = length + draw(st.integers(0, 2 * KEY_BLOCK))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([0.1, 1.0, 4.0]))  # from flat to very peaked softmax
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * groups
    q = (torch.randn(batch, 1, heads, dim, generator=g) * magnitude).transpose(1, 2)
    keys = torch.randn(batch, kv_heads, length, dim, generator=g)
    values = torch.randn(batch, kv_heads, length, dim, generator=g)
    blocks = -(-capacity // KEY_BLOCK)
    nan = float("nan")  # in every position not written: none of it may leak into the output
    layer = PreallocatedLayer(
        torch.full((batch, kv_heads, blocks, dim, KEY_BLOCK), nan),
        torch.full((batch, kv_heads, capacity, dim), nan),
        0,
        blocked_keys=True,
    )
    blocked, held = layer.update(keys, values)
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(batch, length, generator=g) < draw(st.sampled_from([0.2, 0.7]))
        mask[:, -1] = True  # a decoding position always sees itself
    scale = draw(st.sampled_from([dim**-0.5, 0.3]))
    return q, blocked, held, mask, scale


@given(inputs=attention_inputs())
def test_the_kernel_matches_float64_attention(
    kernel: Kernel,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float],
) -> None:
    q, blocked, values, mask, scale = inputs
    length = values.shape[2]
    out = kernel(q, blocked, values, mask, scale)
    expected = reference(q, unblock_keys(blocked, length), values, mask, scale)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5), (
        (out.double() - expected).abs().max()
    )


@given(
    prompt=st.integers(1, 2 * KEY_BLOCK + 3),
    steps=st.lists(st.integers(1, KEY_BLOCK + 3), max_size=5),
    keep=st.lists(st.integers(0, 2), min_size=1, max_size=4),
)
def test_blocked_keys_hold_what_was_written(prompt: int, steps: list[int], keep: list[int]) -> None:
    """Prefill, updates of any size (inside a block, across blocks, whole blocks) and a row
    selection: the blocked keys read back as the same states as the plain layout's."""
    g = torch.Generator().manual_seed(prompt * 100 + len(steps))
    states = torch.randn(3, 2, prompt + sum(steps), 4, generator=g)
    capacity = states.shape[2] + 1
    plain = PreallocatedLayer.from_prompt(
        states[:, :, :prompt], states[:, :, :prompt], None, capacity
    )
    blocked = PreallocatedLayer.from_prompt(
        states[:, :, :prompt], states[:, :, :prompt], None, capacity, blocked_keys=True
    )
    start = prompt
    for n in steps:
        chunk = states[:, :, start : start + n]
        plain_keys, _ = plain.update(chunk, chunk)
        blocked_keys, values = blocked.update(chunk, chunk)
        start += n
        assert blocked_keys.dim() == 5 and blocked_keys.shape[-1] == KEY_BLOCK
        assert torch.equal(unblock_keys(blocked_keys, values.shape[2]), plain_keys)
    rows = torch.tensor(keep)
    plain.keep_rows(rows)
    blocked.keep_rows(rows)
    assert blocked.keys is not None
    assert torch.equal(unblock_keys(blocked.keys, start), states[rows, :, :start])
    assert blocked.get_seq_length() == start and blocked.get_max_length() == capacity


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def test_the_attention_function_is_sdpa_but_for_blocked_keys(kernel: Kernel) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 8, generator=g).transpose(1, 2)
    keys, values = torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
    mask = torch.ones(2, 1, 1, 20, dtype=torch.bool)
    mask[0, 0, 0, :5] = False  # left padding
    sdpa, _ = sdpa_attention_forward(_Module(), q, keys, values, mask, scaling=0.3)
    # Plain keys (a prefill, a caller's own forward): SDPA itself.
    plain, _ = decode_attention_forward(_Module(), q, keys, values, mask, scaling=0.3)
    assert torch.equal(plain, sdpa)
    layer = PreallocatedLayer.from_prompt(keys, values, None, 24, blocked_keys=True)
    blocked, held = layer.update(keys[:, :, :0], values[:, :, :0])
    # Blocked keys with a key-padding mask: the kernel, same answer to rounding.
    out, _ = decode_attention_forward(_Module(), q, blocked, held, mask, scaling=0.3)
    assert torch.allclose(out, sdpa, atol=1e-6) and not torch.equal(out, sdpa)
    assert torch.allclose(out, kernel(q, blocked, held, mask[:, 0, 0], 0.3), atol=0)
    # A mask the kernel does not take (additive, float): SDPA on the unblocked keys.
    additive = torch.zeros(2, 1, 1, 20).masked_fill(~mask, float("-inf"))
    out, _ = decode_attention_forward(_Module(), q, blocked, held, additive, scaling=0.3)
    expected, _ = sdpa_attention_forward(_Module(), q, keys, values, additive, scaling=0.3)
    assert torch.equal(out, expected)


def test_a_kernel_that_cannot_build_leaves_sdpa(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failed build (here: a source the compiler rejects, built in a scratch extension folder)
    is logged with the compiler's words, and the kernel is None: the engine decodes with SDPA."""
    broken = tmp_path / "decode_attention.cpp"
    broken.write_text("#error rlcore test: this source does not compile\n")
    monkeypatch.setattr(decode_attention, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with caplog.at_level(logging.WARNING, logger="rlcore"):
        assert load_kernel.__wrapped__() is None
    assert "could not be built" in caplog.text
    assert "this source does not compile" in caplog.text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFTokenizer]:
    folder = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer(folder, "0123456789+= ")
    build_tiny_llama(folder, vocab_size=16, hidden_size=32, intermediate_size=64, seed=3)
    return folder, HFTokenizer(tokenizer)


def test_the_engine_uses_the_kernel_only_where_it_applies(
    tiny: tuple[Path, HFTokenizer], kernel: Kernel
) -> None:
    folder, tok = tiny
    batch = [Prompt(index=0, text="1+2=", token_ids=tuple(tok.encode("1+2=")))]
    params = SamplingParams(max_new_tokens=4)
    engine = EmbeddedEngine.from_pretrained(folder, tok)
    engine.generate(batch, params)
    assert engine.model.config._attn_implementation == decode_attention.ATTENTION
    off = EmbeddedEngine.from_pretrained(folder, tok, decode_kernel=False)
    off.generate(batch, params)
    assert off.model.config._attn_implementation == "sdpa"
    bf16 = EmbeddedEngine.from_pretrained(folder, tok, dtype=torch.bfloat16)
    bf16.generate(batch, params)  # decodes, with SDPA
    assert bf16.model.config._attn_implementation == "sdpa"
    forced = EmbeddedEngine.from_pretrained(folder, tok, dtype=torch.bfloat16, decode_kernel=True)
    with pytest.raises(
        RolloutError, match=r"decode_kernel=True.*\['torch.bfloat16'\], not float32"
    ):
        forced.generate(batch, params)
