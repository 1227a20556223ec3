"""``candidate``: each backend of :data:`~tests.conformance.candidates.CANDIDATES` in turn, with
the model folder its specs name (built once per backend and session)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rlcore.protocols.stacks import Backend
from tests.conformance.candidates import CANDIDATES


@attrs.frozen
class Under:
    """One backend under test: itself, the model folder its specs name, its vocabulary."""

    name: str
    backend: Backend
    model: Path | None
    vocab: int


@pytest.fixture(scope="session")
def _models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | None]:
    return {}


def _params(*, reads_models: bool = False) -> list[object]:
    return [
        pytest.param(name, marks=c.marks)
        for name, c in sorted(CANDIDATES.items())
        if c.reads_models or not reads_models
    ]


def _under(name: str, factory: pytest.TempPathFactory, models: dict[str, Path | None]) -> Under:
    candidate = CANDIDATES[name]
    if name not in models:
        models[name] = candidate.model(factory.mktemp(f"model-{name}"))
    return Under(name, candidate.backend(), models[name], candidate.vocab)


@pytest.fixture(params=_params())
def candidate(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    _models: dict[str, Path | None],
) -> Under:
    """Every backend under test."""
    return _under(request.param, tmp_path_factory, _models)


@pytest.fixture(params=_params(reads_models=True))
def model_reader(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    _models: dict[str, Path | None],
) -> Under:
    """Every backend under test that builds its models from Hugging Face folders."""
    return _under(request.param, tmp_path_factory, _models)
