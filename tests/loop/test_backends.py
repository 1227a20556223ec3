"""Backends by name (:mod:`rlcore.backends`): a kind for the launcher, a backend for this process;
unknown names and missing packages are clear errors with an install hint."""

from __future__ import annotations

import pytest

from rlcore.backends import KNOWN_BACKENDS, load_backend, load_backend_kind
from rlcore.errors import BackendUnavailableError


def test_unknown_backend_lists_the_known_ones() -> None:
    for load in (load_backend, load_backend_kind):
        with pytest.raises(
            BackendUnavailableError, match="unknown backend 'jax'; known: fsdp, megatron"
        ):
            load("jax")


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        KNOWN_BACKENDS, "nowhere", ("rlcore_nowhere.kind", "KIND", "rlcore[nowhere]")
    )
    for load in (load_backend, load_backend_kind):
        with pytest.raises(
            BackendUnavailableError,
            match=r"needs packages that are not installed \(rlcore_nowhere\)"
            r": pip install 'rlcore\[nowhere\]'",
        ):
            load("nowhere")
