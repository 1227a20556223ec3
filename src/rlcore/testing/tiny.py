"""Tiny, fully local models and tokenizers for tests and benchmarks: the names tests have always
used, from their public home, :mod:`rlcore.new_model`.

Importing this module imports nothing heavy; the functions import torch and transformers when
they run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.new_model import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    Sizes,
    build_char_tokenizer,
    build_model,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_tiny_llama",
]


def build_tiny_llama(
    folder: Path,
    *,
    vocab_size: int,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    **sizes: Any,
) -> PretrainedConfig:
    """:func:`~rlcore.new_model.build_model` of a Llama, its :class:`~rlcore.new_model.Sizes`
    given one by one (``hidden_size=32, num_layers=1``)."""
    return build_model(
        folder,
        vocab_size=vocab_size,
        sizes=Sizes(**sizes),
        tie_word_embeddings=tie_word_embeddings,
        seed=seed,
    )
