"""``rlcore.new_model``: a model folder of any supported family with a tokenizer of one's own
characters or words, built from Python or ``python -m rlcore.new_model``, loads back through the
ordinary Hugging Face entry points and is accepted by the Megatron backend's checks
(``--hf-checkpoint``). ``rlcore.testing.tiny`` keeps the names the tests use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.loop.preflight import check_model_folder
from rlcore.new_model import FAMILIES, build_tokenizer, main
from rlcore.testing.tiny import BOS_ID, EOS_ID, PAD_ID, build_char_tokenizer, build_tiny_llama
from rlcore_megatron.model.arch import SUPPORTED_MODEL_TYPES, arch_from_hf_config

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


def test_words_are_whole_tokens_and_the_longest_wins(tmp_path: Path) -> None:
    tok = build_tokenizer(tmp_path, alphabet=" abc", words=["cab", "ca", "<sep>"])
    vocab = json.loads((tmp_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert list(vocab) == ["<pad>", "<bos>", "<eos>", "cab", "ca", "<sep>", " ", "a", "b", "c"]
    ids = tok.encode("cab ca<sep>cb")
    assert [tok.convert_ids_to_tokens(i) for i in ids] == [
        "<bos>", "cab", " ", "ca", "<sep>", "c", "b"
    ]  # fmt: skip
    assert tok.decode(ids, skip_special_tokens=True) == "cab ca<sep>cb"


def test_left_padding_pads_with_pad_id(tokenizer_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    batch = tok(["1+1=", "12+34="], padding=True)
    assert batch["input_ids"][0] == [PAD_ID, PAD_ID, BOS_ID, 4, 13, 4, 14]
    assert batch["attention_mask"][0] == [0, 0, 1, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("alphabet", "words", "named"),
    [
        ("", (), "alphabet"),
        ("aba", (), "alphabet"),
        ("ab", ("ab", ""), "words"),
        ("ab", ("a",), "alphabet / words"),
        ("ab", ("<eos>",), "words"),
    ],
)
def test_bad_vocabularies_are_refused_by_parameter(
    tmp_path: Path, alphabet: str, words: tuple[str, ...], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        build_tokenizer(tmp_path, alphabet=alphabet, words=words)


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


def test_the_families_are_the_megatron_backends() -> None:
    assert FAMILIES == SUPPORTED_MODEL_TYPES


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_from_the_command_line_loads_and_passes_the_backends_checks(
    tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]
) -> None:
    words = tmp_path / "words.txt"
    words.write_text("apple\npear\n\n")
    folder = tmp_path / "model"
    argv = [str(folder), "--family", family, "--alphabet", "abc ", "--words-file", str(words)]
    assert main([*argv, "--words", "<sep>", "--hidden-size", "32", "--seed", "3"]) == 0
    assert f"wrote a {family} model with a vocabulary of 10 tokens" in capsys.readouterr().out

    # transformers 5's AutoTokenizer swaps a qwen2 folder's tokenizer for Qwen2's own BPE
    # rebuilt from the vocabulary; the class the folder names (what the run loads) is exact.
    auto = PreTrainedTokenizerFast if family == "qwen2" else AutoTokenizer
    tok = auto.from_pretrained(str(folder))
    ids = tok.encode("apple pear<sep>cab")
    assert ids == HFTokenizer.from_folder(folder).encode("apple pear<sep>cab")
    assert [tok.convert_ids_to_tokens(i) for i in ids] == [
        "<bos>", "apple", " ", "pear", "<sep>", "c", "a", "b"
    ]  # fmt: skip
    assert tok.decode(ids, skip_special_tokens=True) == "apple pear<sep>cab"
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert model.config.model_type == family
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tok))
    # What --hf-checkpoint checks before a run starts: the files, and every config.json field.
    problems, hf_config = check_model_folder(folder, "model.hf_checkpoint (--hf-checkpoint)")
    assert problems == []
    arch = arch_from_hf_config(hf_config)
    assert (arch.family, arch.vocab_size, arch.hidden_size) == (family, len(tok), 32)
    assert (arch.moe is not None) == (family == "qwen3_moe")


def test_the_command_line_names_each_bad_argument_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"
    argv = [str(folder), "--family", "qwen3_moe", "--alphabet", "abca", "--num-heads", "3"]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--num-experts", "2", "--num-experts-per-tok", "4", "--num-layers", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--alphabet / --words: ['a'] given more than once" in err
    assert "--num-layers must be at least 1, got 0" in err
    assert not folder.exists()
    with pytest.raises(SystemExit):
        main([str(folder), "--alphabet", "ab", "--num-heads", "3"])
    assert "--hidden-size 64 is not a multiple of --num-heads 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(folder), "--alphabet", "ab", "--family", "qwen3_moe", "--num-experts", "1"])
    assert "--num-experts-per-tok 2 is more than --num-experts 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(folder)])
    assert "give the tokens: --alphabet (characters) and/or --words" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(folder), "--alphabet", "ab", "--words-file", str(tmp_path / "none.txt")])
    assert "--words-file: cannot read" in capsys.readouterr().err
    assert not folder.exists()
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        main([str(folder), "--alphabet", "ab"])
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (folder / "config.json").read_text() == "{}"
