"""The local tiny tokenizer and Llama load back through the ordinary Hugging Face entry points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlcore.testing.tiny import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer, build_tiny_llama

ALPHABET = "0123456789+= "


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(folder, ALPHABET)
    return folder


def test_tokenizer_round_trips_through_auto_tokenizer(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tok.encode("12+34=") == [1, 4, 5, 13, 6, 7, 14]  # bench-tiny section 1
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    assert tok.padding_side == "left"
    assert len(tok) == 3 + len(ALPHABET)
    assert tok.decode([BOS_ID, 4, 5, 15, 14, EOS_ID, PAD_ID], skip_special_tokens=True) == "12 ="


def test_tokenizer_ids_follow_the_alphabet(tmp_path: Path) -> None:
    tok = build_char_tokenizer(tmp_path, "ab")
    assert tok.encode("ba") == [BOS_ID, 4, 3]
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab == {"<pad>": 0, "<bos>": 1, "<eos>": 2, "a": 3, "b": 4}


def test_left_padding_pads_with_pad_id(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    batch = tok(["1+1=", "12+34="], padding=True)
    assert batch["input_ids"][0] == [PAD_ID, PAD_ID, BOS_ID, 4, 13, 4, 14]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1]


@pytest.mark.parametrize("alphabet", ["", "aba"])
def test_bad_alphabet_is_refused(tmp_path: Path, alphabet: str) -> None:
    with pytest.raises(ValueError, match="alphabet"):
        build_char_tokenizer(tmp_path, alphabet)


def test_tiny_llama_loads_back_with_config_and_generation_config(tmp_path: Path) -> None:
    config = build_tiny_llama(
        tmp_path, vocab_size=16, hidden_size=32, num_layers=1, intermediate_size=64
    )
    assert (tmp_path / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == config.vocab_size == 16
    assert model.config.num_hidden_layers == 1
    assert model.dtype == torch.float32
    gen = GenerationConfig.from_pretrained(str(tmp_path))
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    logits = model(torch.tensor([[BOS_ID, 3, 4]])).logits
    assert logits.shape == (1, 3, 16)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tiny_llama_weights_are_a_function_of_the_seed(tmp_path: Path) -> None:
    def build(name: str, seed: int) -> None:
        build_tiny_llama(
            tmp_path / name,
            vocab_size=16,
            hidden_size=32,
            num_layers=1,
            intermediate_size=64,
            seed=seed,
        )

    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    build("a", 7)
    # The caller's global RNG stream is untouched by building a model.
    assert torch.equal(torch.rand(3), before)
    build("b", 7)
    build("c", 8)
    a, b, c = _weights(tmp_path / "a"), _weights(tmp_path / "b"), _weights(tmp_path / "c")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_tiny_llama_tied_embeddings(tmp_path: Path) -> None:
    build_tiny_llama(tmp_path, vocab_size=8, hidden_size=16, num_layers=1, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tiny_llama_refuses_bad_head_counts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_heads"):
        build_tiny_llama(tmp_path, vocab_size=8, hidden_size=30, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        build_tiny_llama(tmp_path, vocab_size=8, num_heads=4, num_kv_heads=3)
