"""What the end-to-end tests share: the CLI's own demo folder (model, tokenizer, prompts), built
once per session by :func:`rlcore.launch.demo.prepare_demo`. Tests read it and never change it
(a test that needs a damaged model copies it first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.launch.demo import prepare_demo


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("demo")
    prepare_demo(folder)
    return folder
