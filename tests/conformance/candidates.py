"""The backends the conformance suite checks. A new backend joins with one line in
:data:`CANDIDATES`: how to build it, the model folder its specs name, and its vocabulary."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import attrs
import pytest

from rlcore.protocols.stacks import Backend
from rlcore.testing import FakeBackend
from tests.megatron.helpers import TINY

ROOT = Path(__file__).resolve().parents[2]


@attrs.frozen
class Candidate:
    """A backend under test: ``backend`` builds it; ``model`` writes the model folder its specs
    name into a fresh folder and returns it (``None``: the backend reads none, it builds its
    model from the spec alone); samples use token ids below ``vocab``; ``marks`` select it."""

    backend: Callable[[], Backend]
    model: Callable[[Path], Path | None]
    vocab: int
    marks: tuple[Any, ...] = ()

    @property
    def reads_models(self) -> bool:
        """Whether its specs name a Hugging Face folder that it builds the model from."""
        return self.model is not _no_model


def _no_model(folder: Path) -> None:
    del folder


def _tiny_llama(folder: Path) -> Path:
    from rlcore.testing.tiny import build_tiny_llama

    build_tiny_llama(folder, **TINY)
    return folder


def _megatron() -> Backend:
    from rlcore_megatron.backend import MegatronBackend

    return MegatronBackend()


def _fsdp() -> Backend:
    from rlcore_fsdp.backend import FSDPBackend

    return FSDPBackend()


def own_backend_example() -> ModuleType:
    """``examples/own_backend.py`` as a module."""
    spec = importlib.util.spec_from_file_location("own_backend", ROOT / "examples/own_backend.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _own_backend() -> Backend:
    backend: Backend = own_backend_example().TorchBackend()
    return backend


CANDIDATES: Final[dict[str, Candidate]] = {
    "fake": Candidate(FakeBackend, _no_model, vocab=32),
    "megatron": Candidate(_megatron, _tiny_llama, vocab=32, marks=(pytest.mark.megatron,)),
    "fsdp": Candidate(_fsdp, _tiny_llama, vocab=32),
    "own-backend-example": Candidate(_own_backend, _no_model, vocab=20),
}
