"""The embedded HF rollout engine on a tiny local Llama: sampling, log-probs, padding, weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.engines.embedded import EmbeddedEngine
from rlcore.engines.sampling import sample_next_tokens
from rlcore.errors import RolloutError
from rlcore.protocols.engine import RolloutEngine
from rlcore.samples import Generation, Prompt, SamplingParams
from rlcore.testing.tiny import EOS_ID, PAD_ID, build_char_tokenizer, build_tiny_llama
from rlcore.weights import Takes, deliver, takes_of

ALPHABET = "0123456789+= "
VOCAB = 3 + len(ALPHABET)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, HFTokenizer]:
    folder = tmp_path_factory.mktemp("tiny")
    hf_tok = build_char_tokenizer(folder / "tokenizer", ALPHABET)
    build_tiny_llama(
        folder / "model",
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        intermediate_size=64,
        seed=3,
    )
    return folder, HFTokenizer(hf_tok)


def make_engine(assets: tuple[Path, HFTokenizer], seed: int = 0) -> EmbeddedEngine:
    folder, tok = assets
    engine = EmbeddedEngine.from_pretrained(folder / "model", tok, seed=seed)
    # A freshly initialised model is nearly uniform; sharpen it so greedy choices are clear-cut
    # (margins far above fp32 noise) and sampling still varies.
    head = engine.model.state_dict()["lm_head.weight"]
    engine.update_weights([("lm_head.weight", head * 40)], version=0)
    return engine


def prompts(tok: HFTokenizer, texts: Sequence[str]) -> list[Prompt]:
    return [Prompt(index=i, text=t, token_ids=tuple(tok.encode(t))) for i, t in enumerate(texts)]


TEXTS = ["12+34=", "1+2=", "99+1=", "7=", "45+45="]


def full_forward_log_probs(
    model: PreTrainedModel, prompt: Prompt, gen: Generation, temperature: float = 1.0
) -> list[float]:
    """``gen``'s tokens' log-probs under ``softmax(logits / temperature)`` of a full forward."""
    ids = torch.tensor([prompt.token_ids + gen.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    n = len(prompt.token_ids)
    log_probs = torch.log_softmax(logits[n - 1 : -1] / temperature, dim=-1)
    return log_probs.gather(-1, torch.tensor(gen.token_ids).unsqueeze(-1)).squeeze(-1).tolist()


def test_is_a_rollout_engine(assets: tuple[Path, HFTokenizer]) -> None:
    engine: RolloutEngine = make_engine(assets)
    assert engine.weight_version == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8),
        SamplingParams(max_new_tokens=8, temperature=0.6, top_k=4),
        SamplingParams(max_new_tokens=8, temperature=1.5, top_p=0.8),
    ],
)
def test_log_probs_are_of_the_tempered_distribution_that_sampled(
    assets: tuple[Path, HFTokenizer], params: SamplingParams
) -> None:
    """``log_softmax(logits / T)`` of a full forward, the whole distribution whatever top-k or
    top-p cut from it (the trainer scores the same), and not the untempered one."""
    engine = make_engine(assets)
    batch = prompts(assets[1], TEXTS) * 3
    gens = engine.generate(batch, params)
    assert len(gens) == len(batch)
    for prompt, gen in zip(batch, gens, strict=True):
        assert len(gen.token_ids) == len(gen.log_probs) >= 1
        expected = full_forward_log_probs(engine.model, prompt, gen, params.temperature)
        assert gen.log_probs == pytest.approx(expected, abs=1e-5)
        if params.temperature != 1.0:
            untempered = full_forward_log_probs(engine.model, prompt, gen)
            assert gen.log_probs != pytest.approx(untempered, abs=1e-3)


def greedy_reference(
    model: PreTrainedModel, prompt: Prompt, max_new_tokens: int
) -> tuple[int, ...]:
    ids = torch.tensor([prompt.token_ids])
    assert isinstance(model, GenerationMixin)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    response = out[0, ids.shape[1] :].tolist()
    return tuple(response[: response.index(EOS_ID) + 1] if EOS_ID in response else response)


def test_greedy_equals_hf_generate(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    batch = prompts(assets[1], TEXTS)
    gens = engine.generate(batch, SamplingParams(max_new_tokens=12, temperature=0.0))
    for prompt, gen in zip(batch, gens, strict=True):
        assert gen.token_ids == greedy_reference(engine.model, prompt, 12)
        assert gen.finish_reason == ("stop" if gen.token_ids[-1] == EOS_ID else "length")
        assert gen.text == assets[1].decode(gen.token_ids)


def test_top_k_1_equals_greedy(assets: tuple[Path, HFTokenizer]) -> None:
    """The same tokens; the log-probs are each one's own distribution's: greedy scores at
    temperature 1, top-k 1 at its temperature, over the whole vocabulary (not 0, as the
    truncated distribution would give)."""
    engine = make_engine(assets)
    batch = prompts(assets[1], TEXTS)
    greedy = engine.generate(batch, SamplingParams(max_new_tokens=8, temperature=0.0))
    top1 = engine.generate(batch, SamplingParams(max_new_tokens=8, temperature=1.3, top_k=1))
    assert [g.token_ids for g in top1] == [g.token_ids for g in greedy]
    for prompt, g, t in zip(batch, greedy, top1, strict=True):
        assert g.log_probs == pytest.approx(
            full_forward_log_probs(engine.model, prompt, g), abs=1e-5
        )
        tempered = full_forward_log_probs(engine.model, prompt, t, 1.3)
        assert t.log_probs == pytest.approx(tempered, abs=1e-5)


def test_left_padding_matches_one_by_one(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    batch = prompts(assets[1], TEXTS)
    assert len({len(p.token_ids) for p in batch}) > 1
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    together = engine.generate(batch, params)
    for prompt, gen in zip(batch, together, strict=True):
        (alone,) = engine.generate([prompt], params)
        assert gen.token_ids == alone.token_ids
        assert gen.log_probs == pytest.approx(alone.log_probs, abs=1e-5)


def test_repeated_prompts_share_a_prefill_but_sample_independently(
    assets: tuple[Path, HFTokenizer],
) -> None:
    engine = make_engine(assets)
    same_length = prompts(assets[1], ["12+34=", "99+11="])
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    alone = [engine.generate([p], greedy)[0] for p in same_length]
    repeated = engine.generate(same_length * 4, greedy)
    for i, gen in enumerate(repeated):
        assert gen.token_ids == alone[i % 2].token_ids
        assert gen.log_probs == pytest.approx(alone[i % 2].log_probs, abs=1e-5)
    sampled = engine.generate(same_length[:1] * 16, SamplingParams(max_new_tokens=8))
    assert len({g.token_ids for g in sampled}) > 1


def test_stop_tokens_cut_responses(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    batch = prompts(assets[1], TEXTS)
    free = engine.generate(
        batch, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(PAD_ID,))
    )
    first = free[0].token_ids
    stop = first[2]
    cut = engine.generate(
        batch, SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(stop,))
    )
    for before, after in zip(free, cut, strict=True):
        if stop in before.token_ids:
            end = before.token_ids.index(stop) + 1
            assert after.token_ids == before.token_ids[:end]
            assert after.finish_reason == "stop"
        else:
            assert after.token_ids == before.token_ids
    assert cut[0].token_ids == first[: first.index(stop) + 1]


def test_stops_early_when_every_response_ended(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    every_token = tuple(range(VOCAB))
    gens = engine.generate(
        prompts(assets[1], TEXTS), SamplingParams(max_new_tokens=50, stop_token_ids=every_token)
    )
    assert all(len(g.token_ids) == 1 and g.finish_reason == "stop" for g in gens)


class OtherEos:
    """The test tokenizer with a different eos id, to see that the engine stops on the tokenizer's
    eos."""

    def __init__(self, tok: HFTokenizer, eos: int) -> None:
        self._tok, self.eos_token_id, self.pad_token_id = tok, eos, tok.pad_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(token_ids)


def test_default_stop_is_the_tokenizers_eos(assets: tuple[Path, HFTokenizer]) -> None:
    model = make_engine(assets).model
    batch = prompts(assets[1], TEXTS)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(PAD_ID,))
    free = EmbeddedEngine(model, assets[1]).generate(batch, params)
    eos = free[0].token_ids[1]
    engine = EmbeddedEngine(model, OtherEos(assets[1], eos))
    gens = engine.generate(batch, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert gens[0].token_ids == free[0].token_ids[: free[0].token_ids.index(eos) + 1]
    assert gens[0].finish_reason == "stop"
    for before, after in zip(free, gens, strict=True):
        assert after.token_ids[-1] == eos or after.token_ids == before.token_ids
        assert after.text == assets[1].decode(after.token_ids)


def test_sampling_is_seeded(assets: tuple[Path, HFTokenizer]) -> None:
    batch = prompts(assets[1], TEXTS) * 4
    params = SamplingParams(max_new_tokens=8)
    a = make_engine(assets, seed=1).generate(batch, params)
    b = make_engine(assets, seed=1).generate(batch, params)
    c = make_engine(assets, seed=2).generate(batch, params)
    assert a == b
    assert [g.token_ids for g in a] != [g.token_ids for g in c]
    assert len({g.token_ids for g in a}) > 1  # it really samples


def test_update_weights_changes_outputs_and_version(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    other = AutoModelForCausalLM.from_pretrained(str(assets[0] / "model"))
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(-3.0)
    batch = prompts(assets[1], TEXTS)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    before = engine.generate(batch, params)
    engine.update_weights(other.state_dict().items(), version=7)
    after = engine.generate(batch, params)
    assert engine.weight_version == 7
    assert all(g.weight_version == 7 for g in after) and all(g.weight_version == 0 for g in before)
    assert [g.log_probs for g in after] != [g.log_probs for g in before]
    for name, tensor in other.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], tensor), name


def test_bad_weight_updates_raise_and_change_nothing(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    bad = [
        ("lm_head.weight", torch.zeros(VOCAB, 32)),
        ("model.layers.9.mlp.up_proj.weight", torch.zeros(3)),
        ("model.norm.weight", torch.zeros(31)),
    ]
    with pytest.raises(RolloutError) as info:
        engine.update_weights(bad, version=3)
    message = str(info.value)
    assert "unknown weight 'model.layers.9.mlp.up_proj.weight'" in message
    assert "'model.norm.weight' has shape (31,), the model's is (32,)" in message
    assert engine.weight_version == 0
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in state.items())


def test_weights_may_come_as_row_blocks_of_their_rows(
    assets: tuple[Path, HFTokenizer],
) -> None:
    """The embedded engine's sink takes a weight as row blocks (``[blocks, rows, *rest]`` of its
    ``[blocks * rows, *rest]``: a strided view of a fused QKV, copied once), and still refuses
    any other shape with the same elements."""
    engine = make_engine(assets)
    name = "model.layers.0.self_attn.q_proj.weight"
    target = engine.model.state_dict()[name]
    rows, cols = target.shape
    fused = torch.randn(2, rows, cols)  # two blocks of half the rows, interleaved with others
    blocks = fused.view(4, rows // 2, cols)[::2]
    assert not blocks.is_contiguous()
    with engine.receive_weights(1) as sinks:
        assert takes_of(sinks) == Takes(row_blocks=True, any_dtype=True)
        deliver([(name, blocks)], sinks)
    assert torch.equal(engine.model.state_dict()[name], blocks.reshape(rows, cols))
    before = target.clone()
    for bad in (torch.zeros(2, rows, cols // 2), torch.zeros(2, rows // 2, cols, 1)):
        with pytest.raises(
            RolloutError, match=rf"'{name}' has shape \({', '.join(map(str, bad.shape))}\)"
        ):
            engine.update_weights([(name, bad)], 2)
    assert torch.equal(engine.model.state_dict()[name], before)


def test_bad_sampling_parameters(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    batch = prompts(assets[1], TEXTS[:1])
    for params in [
        SamplingParams(max_new_tokens=0),
        SamplingParams(max_new_tokens=2, temperature=-1),
        SamplingParams(max_new_tokens=2, top_p=0.0),
        SamplingParams(max_new_tokens=2, top_k=-1),
    ]:
        with pytest.raises(RolloutError, match="bad sampling parameters"):
            engine.generate(batch, params)
    with pytest.raises(RolloutError, match="prompt 0 .* has no tokens"):
        engine.generate([Prompt(index=0, text="", token_ids=())], SamplingParams(max_new_tokens=2))
    with pytest.raises(
        RolloutError, match=rf"prompt 4 .*outside the model's vocabulary \[0, {VOCAB}\)"
    ):
        engine.generate(
            [Prompt(index=4, text="x", token_ids=(1, VOCAB))], SamplingParams(max_new_tokens=2)
        )
    assert engine.generate([], SamplingParams(max_new_tokens=2)) == []


def test_model_failures_become_rollout_errors(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    batch = prompts(assets[1], TEXTS[:2])
    # A stop id beyond the vocabulary is harmless; NaN weights make sampling fail inside torch.
    engine.update_weights([("lm_head.weight", torch.full((VOCAB, 32), float("nan")))], version=1)
    with pytest.raises(RolloutError, match="generation failed for 2 prompts") as info:
        engine.generate(batch, SamplingParams(max_new_tokens=3))
    assert isinstance(info.value.__cause__, RuntimeError)


def test_close_and_bad_folder(assets: tuple[Path, HFTokenizer], tmp_path: Path) -> None:
    engine = make_engine(assets)
    engine.close()
    engine.close()
    with pytest.raises(RolloutError, match="closed"):
        engine.generate(prompts(assets[1], TEXTS[:1]), SamplingParams(max_new_tokens=2))
    with pytest.raises(RolloutError, match=r"cannot load a causal LM from .*nothing"):
        EmbeddedEngine.from_pretrained(tmp_path / "nothing", assets[1])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)

    def seen(params: SamplingParams, draws: int) -> set[int]:
        return {int(sample_next_tokens(logits, params, gen)[0]) for _ in range(draws)}

    assert seen(SamplingParams(1, top_p=0.75), 300) == {0, 1}
    assert seen(SamplingParams(1, top_p=0.1), 50) == {0}
    assert seen(SamplingParams(1, top_k=3), 300) == {0, 1, 2}


def test_ignore_eos_generates_exactly_max_new_tokens(assets: tuple[Path, HFTokenizer]) -> None:
    engine = make_engine(assets)
    batch = prompts(assets[1], TEXTS)
    every_token = tuple(range(VOCAB))
    params = SamplingParams(max_new_tokens=9, stop_token_ids=every_token, ignore_eos=True)
    gens = engine.generate(batch, params)
    assert all(len(g.token_ids) == 9 and g.finish_reason == "length" for g in gens)
    for prompt, gen in zip(batch, gens, strict=True):
        assert gen.log_probs == pytest.approx(
            full_forward_log_probs(engine.model, prompt, gen), abs=1e-5
        )


def test_new_weights_mid_generation_interrupt_it_and_it_goes_on_with_them(
    assets: tuple[Path, HFTokenizer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial rollout: an update from another thread stops the generation at a token
    boundary; the rest of every response is sampled from the new weights, after the context is
    recomputed with them, and each token's log-prob is its own version's."""
    import threading

    import rlcore.engines.decode_loop as decode_loop
    from rlcore.engines.sampling import sample_next_tokens

    engine = make_engine(assets, seed=5)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v * 1.5 if k == "lm_head.weight" else v.clone() for k, v in old.items()}
    calls = 0
    updater: threading.Thread | None = None
    real = sample_next_tokens

    def sample(
        logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nonlocal calls, updater
        calls += 1
        if calls == 4:  # after the 4th token, new weights arrive from another thread

            def update() -> None:
                with engine.receive_weights_interrupting(1) as sinks:
                    sinks[0].receive(new.items())

            updater = threading.Thread(target=update)
            updater.start()
            while not engine._interrupt.is_set():  # the update is waiting: stop at this token
                pass
        return real(logits, params, gen)

    monkeypatch.setattr(decode_loop, "sample_next_tokens", sample)
    batch = prompts(assets[1], TEXTS)
    generations = engine.generate(batch, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert updater is not None
    updater.join()
    assert engine.weight_version == 1
    old_model = make_engine(assets).model
    old_model.load_state_dict(old)
    for prompt, g in zip(batch, generations, strict=True):
        assert len(g.token_ids) == 10 and g.finish_reason == "length"
        assert (g.first_weight_version, g.weight_version) == (0, 1)
        before = full_forward_log_probs(old_model, prompt, g)[:4]
        after = full_forward_log_probs(engine.model, prompt, g)[4:]
        assert g.log_probs[:4] == pytest.approx(before, abs=1e-5)
        assert g.log_probs[4:] == pytest.approx(after, abs=1e-5)
    # Without new weights in flight, a generation is one version throughout.
    again = engine.generate(batch, SamplingParams(max_new_tokens=3))
    assert all((g.first_weight_version, g.weight_version) == (1, 1) for g in again)
