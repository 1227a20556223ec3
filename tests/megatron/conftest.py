"""Fixtures for the Megatron-on-CPU tests: one single-process Megatron rank per test session
(tensor parallel 1) and tiny HF Llama checkpoints written by ``transformers.save_pretrained``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rlcore.testing.tiny import build_tiny_llama
from tests.families import FamilyModels
from tests.megatron.helpers import TINY


@pytest.fixture(scope="session")
def megatron_rank() -> Iterator[None]:
    """This process as Megatron rank 0 of 1 (idempotent: the backend calls the same init)."""
    from rlcore_megatron.parallel import init_megatron

    init_megatron(tp_size=1, seed=1234)
    yield


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory, megatron_rank: None) -> Path:
    """An untied tiny Llama (hidden 32, 2 layers, 4 heads over 2 KV groups, vocab 32)."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    build_tiny_llama(folder, **TINY)
    return folder


@pytest.fixture(scope="session")
def tiny_hf_tied(tmp_path_factory: pytest.TempPathFactory, megatron_rank: None) -> Path:
    """The same tiny Llama with tied input and output embeddings."""
    folder = tmp_path_factory.mktemp("tiny_llama_tied")
    build_tiny_llama(folder, **{**TINY, "tie_word_embeddings": True})
    return folder


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory, megatron_rank: None) -> FamilyModels:
    """Checkpoints of each supported model family (``tests/families.py``), built on demand."""
    return FamilyModels(tmp_path_factory.mktemp("families"))
