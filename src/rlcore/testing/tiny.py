"""Tiny, fully local models and tokenizers for tests, demos and benchmarks.

Nothing here downloads anything: the tokenizer is built from an alphabet with ``tokenizers`` and
the model is a freshly initialised ``transformers.LlamaForCausalLM``, both written with
``save_pretrained`` so they load back with ``AutoTokenizer`` / ``AutoModelForCausalLM`` exactly like
a real Hugging Face checkpoint. The no-flag demo builds its model with them, and
``benchmarks/bench_tiny.py`` builds bench-tiny's assets with them.

This module imports torch and transformers at import time; ``import rlcore`` does not import it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_tiny_llama",
]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
"""The special tokens, in id order: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2."""


def build_char_tokenizer(
    folder: Path, alphabet: str, *, model_max_length: int = 128
) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer and ``save_pretrained`` it into ``folder``.

    Ids: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, then one id per character of ``alphabet`` in
    order (so ``"0123456789+= "`` gives bench-tiny's 16-token vocabulary). Encoding prepends
    ``<bos>``; decoding concatenates characters with no separator; padding is on the left (the
    rollout engine left-pads prompts). There is no ``<unk>``: encoding a character outside the
    alphabet raises ``Exception("WordLevel error: Missing [UNK] token ...")``, as ``WordLevel``
    without an unknown token does (:func:`rlcore.data.load_prompts` names the character).

    With ``alphabet="0123456789+= "`` the saved ``tokenizer.json`` is byte-identical to
    bench-tiny's. Raises ``ValueError`` when the alphabet is empty or repeats a character.
    """
    if not alphabet:
        raise ValueError(
            "build_char_tokenizer: the alphabet is empty; pass the characters to encode"
        )
    repeated = sorted({c for c in alphabet if alphabet.count(c) > 1})
    if repeated:
        raise ValueError(
            f"build_char_tokenizer: the alphabet repeats {repeated!r}; list each character once"
        )
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", BOS_ID)]
    )
    tokenizer.decoder = decoders.Fuse()
    # Register the specials so that ``skip_special_tokens`` drops them when decoding.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))

    # transformers declares this constructor as ``__init__(self, *args, **kwargs)`` without
    # annotations.
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
        model_max_length=model_max_length,
    )
    folder.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(folder))
    return wrapped


def build_tiny_llama(
    folder: Path,
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 128,
    tie_word_embeddings: bool = False,
    seed: int = 0,
) -> LlamaConfig:
    """Create a randomly initialised fp32 ``LlamaForCausalLM`` and ``save_pretrained`` it.

    The weights depend only on the arguments (``torch.manual_seed(seed)`` right before
    construction, as bench-tiny's recipe does) and on the torch/transformers versions. The folder
    gets ``config.json``, ``model.safetensors`` and a ``generation_config.json`` with bos = 1,
    eos = 2, pad = 0 (the ids :func:`build_char_tokenizer` assigns). The global torch RNG state is
    restored afterwards, so building a model does not perturb the caller's random stream.
    """
    if hidden_size % num_heads:
        raise ValueError(
            f"build_tiny_llama: hidden_size {hidden_size} is not a multiple of "
            f"num_heads {num_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"build_tiny_llama: num_heads {num_heads} is not a multiple of "
            f"num_kv_heads {num_kv_heads}"
        )
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        dtype="float32",
    )
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)
    # GenerationConfig's constructor takes untyped ``**kwargs``.
    model.generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    return config
