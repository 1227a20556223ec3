"""Shared by the embedded-engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The tiny models gain nothing from threads, and on a busy shared host extra OpenMP threads
    spin-wait for cores; one thread keeps these tests fast and their timing steady."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
