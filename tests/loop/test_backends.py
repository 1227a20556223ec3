"""Backends by name (the class, and a whole run with ``rlcore.execute``): unknown names and
missing packages are clear errors with an install hint."""

from __future__ import annotations

import pytest

from rlcore.config import RolloutConfig, RunConfig
from rlcore.errors import BackendUnavailableError
from rlcore.loop.backends import KNOWN_BACKENDS, RUNNERS, execute, load_backend


def test_unknown_backend_lists_the_known_ones() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown backend 'jax'; known: megatron"):
        load_backend("jax")


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        KNOWN_BACKENDS, "nowhere", ("rlcore_nowhere.backend", "Backend", "rlcore[nowhere]")
    )
    with pytest.raises(
        BackendUnavailableError,
        match=r"needs packages that are not installed \(rlcore_nowhere\)"
        r": pip install 'rlcore\[nowhere\]'",
    ):
        load_backend("nowhere")


def test_execute_names_an_unknown_backend_and_a_missing_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = RunConfig(rollout=RolloutConfig(num_rollout=1))
    with pytest.raises(BackendUnavailableError, match="unknown backend 'jax'; known: megatron"):
        execute(config, backend="jax")
    monkeypatch.setitem(RUNNERS, "nowhere", "rlcore_nowhere.run")
    monkeypatch.setitem(
        KNOWN_BACKENDS, "nowhere", ("rlcore_nowhere.backend", "Backend", "rlcore[nowhere]")
    )
    with pytest.raises(BackendUnavailableError, match=r"pip install 'rlcore\[nowhere\]'"):
        execute(config, backend="nowhere")
