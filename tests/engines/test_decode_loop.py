"""The embedded engine's decode loop on every model family it serves (rlcore's tiny Llama and the
cut-down published Llama 3, Qwen2.5 (also with sliding-window layers), Qwen3 and Qwen3-MoE configs
of tests/families.py): the preallocated cache against a cache-free reference, ended rows leaving
the batch, and the sampling distribution once they have."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache, GenerationMixin, PreTrainedModel

from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.engines.decode_attention import ATTENTION
from rlcore.engines.embedded import EmbeddedEngine
from rlcore.engines.kv_cache import DecodeCache, PreallocatedLayer, unblock_keys
from rlcore.engines.sampling import sample_next_tokens
from rlcore.samples import Prompt, SamplingParams
from rlcore.testing.tiny import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer, build_tiny_llama
from tests.families import Family, build_family_model, tiny_config

ALPHABET = "0123456789+= "
VOCAB = 3 + len(ALPHABET)
NEVER = VOCAB + 1  # a stop id the model cannot sample: no row ends early
TEXTS = ["12+34=", "1+2=", "99+1=", "7=", "45+45=", "123+456=", "3+3="]

# The tests' cut-down published configs (tests/families.py), on this file's 16-token vocabulary;
# untied, so that sharpening the output layer leaves the input embeddings alone.
SMALL_VOCAB: dict[str, Any] = {
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
}
BUILDS: dict[str, tuple[Family, dict[str, Any]]] = {
    "llama3": ("llama", {}),  # Llama 3 RoPE scaling, explicit head_dim, GQA ratio 4
    "qwen2": ("qwen2", {}),  # biased q/k/v projections, GQA ratio 7
    # Layer 1 attends to a 4-token window: not a full-attention layer, the cache keeps its own.
    "qwen2-sliding": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {}),  # q/k RMS norms, head_dim * heads != hidden
    "qwen3-moe": ("qwen3_moe", {}),  # 16 experts, 8 per token
}


def _build(folder: Path, family: str) -> None:
    if (
        family == "llama"
    ):  # the library's own tiny Llama (rlcore.testing.tiny), as bench-tiny builds it
        build_tiny_llama(folder, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, seed=7)
        return
    published, overrides = BUILDS[family]
    config = tiny_config(published, **SMALL_VOCAB, **overrides)
    build_family_model(folder, config, seed=7)
    if family == "qwen2-sliding":
        layer_types = json.loads((folder / "config.json").read_text())["layer_types"]
        assert layer_types == ["full_attention", "sliding_attention"]


FAMILIES = ["llama", *BUILDS]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return HFTokenizer(build_char_tokenizer(tmp_path_factory.mktemp("tok"), ALPHABET))


@pytest.fixture(scope="module", params=FAMILIES)
def engine_factory(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer: HFTokenizer,
) -> Callable[..., EmbeddedEngine]:
    family: str = request.param
    folder = tmp_path_factory.mktemp(family)
    _build(folder, family)

    def make(seed: int, sharpen: float = 30.0, decode_kernel: bool = True) -> EmbeddedEngine:
        # The kernel by default (and a failure if it cannot run); SDPA where a test asks.
        engine = EmbeddedEngine.from_pretrained(
            folder, tokenizer, seed=seed, decode_kernel=decode_kernel
        )
        # Sharpen the near-uniform fresh model so that next-token distributions depend clearly
        # on the prefix (and, at 30, greedy margins sit far above fp32 noise).
        head = engine.model.state_dict()["lm_head.weight"]
        engine.update_weights([("lm_head.weight", head * sharpen)], version=0)
        return engine

    return make


def encode(tok: HFTokenizer, texts: Sequence[str]) -> list[Prompt]:
    return [Prompt(index=i, text=t, token_ids=tuple(tok.encode(t))) for i, t in enumerate(texts)]


def next_token_logits(model: PreTrainedModel, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """``Tensor[len(rows), V]``: each row's next-token logits from a full forward, no cache."""
    out = []
    with torch.no_grad():
        for ids in rows:
            out.append(model(input_ids=torch.tensor([list(ids)])).logits[0, -1].float())
    return torch.stack(out)


def full_forward_log_probs(
    model: PreTrainedModel, pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]
) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[float]]:
    """Each distinct (prompt, answer)'s answer-token log-probs from one full forward, no cache;
    sequences of one length and prompt length share a forward."""
    groups: dict[tuple[int, int], list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for prompt, answer in dict.fromkeys(pairs):
        groups.setdefault((len(prompt), len(answer)), []).append((prompt, answer))
    out = {}
    with torch.no_grad():
        for (n, m), group in groups.items():
            ids = torch.tensor([list(prompt + answer) for prompt, answer in group])
            logits = model(input_ids=ids).logits[:, n - 1 : n + m - 1].float()
            picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, n:].unsqueeze(-1))
            for pair, row in zip(group, picked.squeeze(-1).tolist(), strict=True):
                out[pair] = row
    return out


def cache_free_reference(
    model: PreTrainedModel, batch: Sequence[Prompt], params: SamplingParams, seed: int
) -> list[tuple[list[int], list[float]]]:
    """The decode loop with no cache at all, for batches where no row stops early: every step runs
    each full sequence through the model and samples all rows together from one generator seeded
    like the engine's, so the engine must reproduce it draw for draw."""
    generator = torch.Generator().manual_seed(seed)
    seqs = [list(p.token_ids) for p in batch]
    out: list[tuple[list[int], list[float]]] = [([], []) for _ in batch]
    for _ in range(params.max_new_tokens):
        logits = next_token_logits(model, seqs)
        tokens, _ = sample_next_tokens(logits, params, generator)
        scale = params.temperature or 1.0  # greedy scores at temperature 1
        log_probs = torch.log_softmax(logits / scale, dim=-1)
        log_probs = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        for row, (token, log_prob) in enumerate(
            zip(tokens.tolist(), log_probs.tolist(), strict=True)
        ):
            seqs[row].append(token)
            out[row][0].append(token)
            out[row][1].append(log_prob)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=12, stop_token_ids=(NEVER,)),
        SamplingParams(max_new_tokens=12, temperature=0.8, top_k=6, stop_token_ids=(NEVER,)),
        SamplingParams(max_new_tokens=12, temperature=1.2, top_p=0.9, stop_token_ids=(NEVER,)),
    ],
)
def test_sampling_matches_a_cache_free_loop_draw_for_draw(
    engine_factory: Callable[..., EmbeddedEngine],
    tokenizer: HFTokenizer,
    params: SamplingParams,
) -> None:
    # Prompts of several lengths (left padding), each twice (shared prefill), no early stop.
    batch = encode(tokenizer, TEXTS) * 2
    engine = engine_factory(11, sharpen=5.0)  # peaked, yet every family really samples
    gens = engine.generate(batch, params)
    expected = cache_free_reference(engine.model, batch, params, seed=11)
    for gen, (tokens, log_probs) in zip(gens, expected, strict=True):
        assert list(gen.token_ids) == tokens
        assert list(gen.log_probs) == pytest.approx(log_probs, abs=1e-5)
        assert gen.finish_reason == "length"
    assert len({g.token_ids for g in gens}) > len(TEXTS)  # it really samples


def greedy_reference(
    model: PreTrainedModel, prompt: Prompt, max_new_tokens: int, stops: Sequence[int]
) -> tuple[int, ...]:
    ids = torch.tensor([prompt.token_ids])
    assert isinstance(model, GenerationMixin)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=list(stops),
        pad_token_id=PAD_ID,
    )
    response: list[int] = out[0, ids.shape[1] :].tolist()
    ends = [i for i, t in enumerate(response) if t in stops]
    return tuple(response[: ends[0] + 1] if ends else response)


class RowsPerForward:
    """Records the batch size of every forward pass of a model (a forward pre-hook)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.sizes: list[int] = []
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(
        self, module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> None:
        input_ids = kwargs["input_ids"]
        assert isinstance(input_ids, torch.Tensor)
        self.sizes.append(int(input_ids.shape[0]))

    def remove(self) -> None:
        self._handle.remove()


def test_rows_that_stop_leave_the_batch_and_the_rest_are_unchanged(
    engine_factory: Callable[..., EmbeddedEngine], tokenizer: HFTokenizer
) -> None:
    engine = engine_factory(0)
    batch = encode(tokenizer, TEXTS) * 3
    free = engine.generate(batch, SamplingParams(max_new_tokens=16, temperature=0.0))

    # Stop on the one or two tokens that end the free-running answers at the most different
    # steps, so rows end at many different times and the survivors are compacted several times.
    def end_steps(stops: tuple[int, ...]) -> set[int]:
        return {next((i for i, t in enumerate(g.token_ids) if t in stops), 16) for g in free}

    candidates = [(a,) for a in range(VOCAB)] + [
        (a, b) for a in range(VOCAB) for b in range(a + 1, VOCAB)
    ]
    stops = max(candidates, key=lambda c: (len(end_steps(c)), -len(c)))
    assert len(end_steps(stops)) >= 3
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=stops)
    counter = RowsPerForward(engine.model)
    try:
        gens = engine.generate(batch, params)
    finally:
        counter.remove()
    for prompt, gen in zip(batch, gens, strict=True):
        assert gen.token_ids == greedy_reference(engine.model, prompt, 16, stops)
        assert gen.finish_reason == ("stop" if gen.token_ids[-1] in stops else "length")
        ids = torch.tensor([prompt.token_ids + gen.token_ids])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0].float()
        n = len(prompt.token_ids)
        full = torch.log_softmax(logits[n - 1 : -1], dim=-1)
        expected = full.gather(-1, torch.tensor(gen.token_ids).unsqueeze(-1)).squeeze(-1)
        assert list(gen.log_probs) == pytest.approx(expected.tolist(), abs=1e-5)
    lengths = [len(g.token_ids) for g in gens]
    assert min(lengths) < max(lengths)
    prefill, *decode = counter.sizes
    assert prefill == len(TEXTS)  # each distinct prompt once
    assert decode == sorted(decode, reverse=True) and decode[-1] < len(batch)
    # Each row is fed back (its length - 1) times; ended rows wait in the batch until they are an
    # eighth of it, so at most 8/7 of that is computed.
    assert sum(decode) <= 8 / 7 * sum(n - 1 for n in lengths) + 1


def test_sampling_stays_exact_after_rows_leave(
    engine_factory: Callable[..., EmbeddedEngine], tokenizer: HFTokenizer
) -> None:
    """After rows are dropped the survivors draw from the generator in another order than a loop
    that keeps every row would; the distribution of what they sample must not change, and each
    token must still be sampled from its own row's context. Each position's tokens, counted per
    prompt and prefix, are compared with the model's conditional probabilities (fixed seed:
    deterministic), and every distinct answer's log-probs with a full forward."""
    engine = engine_factory(3, sharpen=5.0)  # peaked enough to depend on the context, not more
    prompts = encode(tokenizer, ["12+34=", "99+11=", "7+7=", "45+45="])
    probs = torch.softmax(next_token_logits(engine.model, [p.token_ids for p in prompts]), dim=-1)
    mean = probs.mean(dim=0)
    order = mean.argsort(descending=True).tolist()
    # Stop on the likeliest first tokens until about 40% of the rows end at step 1.
    stops: list[int] = []
    while float(mean[stops].sum()) < 0.4:
        stops.append(order[len(stops)])
    batch = prompts * 750
    counter = RowsPerForward(engine.model)
    try:
        gens = engine.generate(batch, SamplingParams(max_new_tokens=3, stop_token_ids=tuple(stops)))
    finally:
        counter.remove()
    assert counter.sizes[1] < len(batch)  # rows left the batch after the first token
    checked = 0
    for position in range(3):
        reached = [
            p.token_ids + g.token_ids[:position]
            for p, g in zip(batch, gens, strict=True)
            if len(g.token_ids) > position
        ]
        tokens = [g.token_ids[position] for g in gens if len(g.token_ids) > position]
        by_context = Counter(reached)
        contexts = [c for c, count in by_context.items() if count >= 50]
        if not contexts:
            continue
        conditional = torch.softmax(next_token_logits(engine.model, contexts), dim=-1)
        for context, row in zip(contexts, conditional, strict=True):
            seen = Counter(t for c, t in zip(reached, tokens, strict=True) if c == context)
            _assert_counts_match(seen, row * by_context[context], label=f"after {context}")
            checked += 1
    assert checked > len(prompts)  # some contexts after the first token too
    expected = full_forward_log_probs(
        engine.model, [(p.token_ids, g.token_ids) for p, g in zip(batch, gens, strict=True)]
    )
    answers = {(p.token_ids, g.token_ids): g.log_probs for p, g in zip(batch, gens, strict=True)}
    for (prompt_ids, answer), log_probs in answers.items():
        assert list(log_probs) == pytest.approx(expected[(prompt_ids, answer)], abs=1e-5)


def _assert_counts_match(observed: Counter[int], expected: torch.Tensor, label: str = "") -> None:
    """Pearson's chi-square test of ``observed`` counts against ``expected`` (``Tensor[V]``),
    tokens expected fewer than 5 times pooled into one bin, at significance 1e-5 (critical value
    by the Wilson-Hilferty approximation): loose against chance, while a row-mixing bug moves
    whole distributions."""
    bins: list[tuple[float, float]] = []
    pooled = [0.0, 0.0]
    for token in range(expected.shape[0]):
        mean = float(expected[token])
        if mean >= 5:
            bins.append((observed[token], mean))
        else:
            pooled[0] += observed[token]
            pooled[1] += mean
    if pooled[1] > 0:
        bins.append((pooled[0], pooled[1]))
    dof = len(bins) - 1
    if dof < 1:
        return
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    z = 4.265  # the standard normal's upper 1e-5 quantile
    critical = dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    assert statistic <= critical, (label, statistic, critical, observed, expected)


@pytest.mark.parametrize("blocked_keys", [False, True], ids=["plain", "blocked"])
def test_the_cache_reads_only_what_was_written(
    engine_factory: Callable[..., EmbeddedEngine], tokenizer: HFTokenizer, blocked_keys: bool
) -> None:
    """Built from a prefill, a DecodeCache preallocates full-attention layers, keeps other kinds,
    hands attention only the written positions and drops rows on request (with keys in either
    layout: blocked keys go to the decode kernel)."""
    engine = engine_factory(0, decode_kernel=blocked_keys)
    model = engine.model
    if blocked_keys:
        model.set_attn_implementation(ATTENTION)
    prompts = encode(tokenizer, ["12+34=", "99+11="])
    ids = torch.tensor([list(p.token_ids) for p in prompts])
    prefill = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=prefill, use_cache=True)
    width = ids.shape[1]
    kinds = [type(layer).__name__ for layer in prefill.layers]
    before = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.layers]  # type: ignore[union-attr]  # filled by the prefill
    rows = torch.tensor([0, 1, 1, 0])
    cache = DecodeCache(prefill, rows, capacity=width + 3, blocked_keys=blocked_keys)

    def written_keys(layer: PreallocatedLayer) -> torch.Tensor:
        assert layer.keys is not None
        return unblock_keys(layer.keys, layer.get_seq_length()) if blocked_keys else layer.keys

    for kind, layer, (keys, _) in zip(kinds, cache.layers, before, strict=True):
        if kind == "DynamicLayer":
            assert isinstance(layer, PreallocatedLayer)
            assert layer.get_max_length() == width + 3 and layer.get_seq_length() == width
            assert torch.equal(written_keys(layer), keys[rows])
        else:  # a sliding-window layer stays what transformers built
            assert not isinstance(layer, PreallocatedLayer)
    assert any(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    step = torch.tensor([[5], [6], [7], [8]])
    with torch.no_grad():
        model(input_ids=step, cache=cache, use_cache=True)
    cache.keep_rows(torch.tensor([1, 3]))
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            assert written_keys(layer).shape[0] == 2
            assert layer.get_seq_length() == width + 1
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[9], [9]]), cache=cache, use_cache=True).logits
    full = next_token_logits(
        model, [list(prompts[1].token_ids) + [6, 9], list(prompts[0].token_ids) + [8, 9]]
    )
    assert torch.allclose(logits[:, -1].float(), full, atol=1e-5)


def test_the_kernel_and_sdpa_decode_alike(
    engine_factory: Callable[..., EmbeddedEngine], tokenizer: HFTokenizer
) -> None:
    """The decode kernel and torch's SDPA, on left-padded prompts whose rows end (and leave the
    batch) at different steps: the same draws, log-probs equal to float rounding."""
    batch = encode(tokenizer, TEXTS) * 3
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(3, 4, 5))
    kernel = engine_factory(5, sharpen=5.0).generate(batch, params)
    sdpa = engine_factory(5, sharpen=5.0, decode_kernel=False).generate(batch, params)
    assert len({len(g.token_ids) for g in kernel}) > 1  # rows ended at different steps
    for a, b in zip(kernel, sdpa, strict=True):
        assert a.token_ids == b.token_ids
        assert list(a.log_probs) == pytest.approx(b.log_probs, abs=1e-5)


@pytest.mark.parametrize("blocked_keys", [False, True], ids=["plain", "blocked"])
def test_a_full_cache_refuses_more_positions(blocked_keys: bool) -> None:
    keys = torch.zeros(2, 1, 3, 4)
    layer = PreallocatedLayer.from_prompt(keys, keys, None, capacity=4, blocked_keys=blocked_keys)
    layer.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4))
    with pytest.raises(RuntimeError, match="5 positions do not fit the 4 allocated"):
        layer.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4))
    with pytest.raises(ValueError, match="capacity 2 is below the prompt length 3"):
        PreallocatedLayer.from_prompt(keys, keys, None, capacity=2)


def test_a_bf16_engine_drops_ended_rows_and_keeps_exact_log_probs(
    tmp_path: Path, tokenizer: HFTokenizer
) -> None:
    """In bf16 (``--bf16`` builds the engine in the trainer's dtype) rows still leave the batch as
    they end, and each answer's log-probs match a bf16 full forward (to bf16's resolution)."""
    _build(tmp_path, "qwen3")
    engine = EmbeddedEngine.from_pretrained(tmp_path, tokenizer, seed=0, dtype=torch.bfloat16)
    batch = encode(tokenizer, TEXTS) * 4
    counter = RowsPerForward(engine.model)
    try:
        gens = engine.generate(batch, SamplingParams(max_new_tokens=12, stop_token_ids=(3, 4, 5)))
    finally:
        counter.remove()
    assert len({len(g.token_ids) for g in gens}) > 1  # some answers ended early
    assert min(counter.sizes[1:]) < len(batch)  # and left the batch
    expected = full_forward_log_probs(
        engine.model, [(p.token_ids, g.token_ids) for p, g in zip(batch, gens, strict=True)]
    )
    for prompt, gen in zip(batch, gens, strict=True):
        assert list(gen.log_probs) == pytest.approx(
            expected[(prompt.token_ids, gen.token_ids)], abs=3e-2
        )
