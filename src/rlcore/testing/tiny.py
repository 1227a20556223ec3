"""Tiny, fully local models and tokenizers for tests and benchmarks: the names tests have always
used, from their public home, :mod:`rlcore.new_model` (``build_tiny_llama`` is its
:func:`~rlcore.new_model.build_model`, whose family defaults to ``llama``).

Importing this module imports nothing heavy; the functions import torch and transformers when
they run.
"""

from __future__ import annotations

from rlcore.new_model import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, build_char_tokenizer
from rlcore.new_model import build_model as build_tiny_llama

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "build_char_tokenizer",
    "build_tiny_llama",
]
