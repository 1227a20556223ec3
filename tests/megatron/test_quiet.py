"""Megatron's start-up warnings that no user can act on are ignored once ``rlcore_megatron`` is
imported (``rlcore_megatron.QUIET``), each by its message and the module that warns: the same
message from elsewhere, and Megatron's other warnings, still show."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.megatron

# Imports that warn when Megatron has no Transformer Engine or Apex, and a TransformerConfig
# (Megatron's own default cuda_graph_scope warns); then the same messages from elsewhere.
_CODE = """
import warnings
{first}
import megatron.core.optimizer
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import TransformerConfig
TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
warnings.warn_explicit("Apex is not installed (elsewhere)", UserWarning, "m.py", 1, module="m")
warnings.warn_explicit("Apex is missing a kernel", UserWarning, "x.py", 1, module="megatron.core.x")
"""


def _stderr(first: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CODE.format(first=first)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return done.stderr


def test_megatrons_start_up_warnings_are_ignored_and_only_they() -> None:
    loud, quiet = _stderr(""), _stderr("import rlcore_megatron")
    for message in (
        "Transformer Engine and Apex are not installed",
        "UserWarning: Apex is not installed. Falling back to Torch Norm",
        "full scope is deprecated",
    ):
        assert message in loud  # what Megatron says without the filters
        assert message not in quiet
    for other in ("Apex is not installed (elsewhere)", "Apex is missing a kernel"):
        assert other in loud and other in quiet
