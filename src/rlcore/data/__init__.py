"""Prompt data: reading prompt files, tokenizing them, and handing them out batch by batch.

- :mod:`~rlcore.data.prompts`: :func:`load_prompts` and :func:`load_eval_sets`, which read and
  tokenize every prompt of a file and check each record;
- :mod:`~rlcore.data.files`: the files themselves, JSON lines (``.jsonl``) or Parquet
  (``.parquet``, needs ``pyarrow``: ``pip install 'rlcore[data]'``), record by record;
- :mod:`~rlcore.data.hf_tokenizer`: :class:`HFTokenizer`, a Hugging Face tokenizer as rlcore's
  :class:`~rlcore.protocols.tokenizer.ChatTokenizer`;
- :mod:`~rlcore.data.sampler`: :class:`PromptSampler`, the resumable prompt stream.

Anything malformed raises :class:`~rlcore.errors.DataError` naming the file, the 1-based line (or
row) and what to do, before a single rollout runs. The tokenizer comes in through the small
:class:`~rlcore.protocols.tokenizer.Tokenizer` protocol (re-exported here, with
:class:`~rlcore.protocols.tokenizer.ChatTokenizer`), so this room imports neither transformers nor
torch until a Hugging Face tokenizer is loaded. The names below are re-exported from their modules
for code that imports them from ``rlcore.data``.
"""

from __future__ import annotations

from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.data.prompts import load_eval_sets, load_prompts
from rlcore.data.sampler import PromptSampler
from rlcore.protocols.tokenizer import ChatTokenizer, Tokenizer

__all__ = [
    "ChatTokenizer",
    "HFTokenizer",
    "PromptSampler",
    "Tokenizer",
    "load_eval_sets",
    "load_prompts",
]
