"""The algorithm tests use tiny tensors: one intra-op thread avoids thread hand-off costs that
dominate on a busy machine. Restored after the package, so other test packages are unaffected."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _single_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
