"""bench-tiny's fixtures (benchmarks/bench_tiny.py): the assets are built, not downloaded, and
the partial-credit reward scores as the workload defines it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer, LlamaForCausalLM

from benchmarks.bench_tiny import (
    REFERENCE_SHA256,
    build_assets,
    prefix_partial,
    prompt_rows,
    sha256_of,
)
from rlcore.samples import Generation, Prompt

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "bench-tiny" / "WORKLOAD.md"
"""The workload's definition where CI lays it beside the clone; absent in a user's clone."""


def P(label: str) -> Prompt:
    return Prompt(index=0, text="q", token_ids=(1,), label=label)


def G(text: str) -> Generation:
    return Generation(token_ids=(), log_probs=(), text=text)


def _published_hashes(workload: Path) -> dict[str, str]:
    """The ``name  sha256`` lines of WORKLOAD.md's asset hash list."""
    found = re.findall(r"^(\S+)\s+([0-9a-f]{64})$", workload.read_text(), flags=re.MULTILINE)
    return dict(found)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_assets(tmp_path_factory.mktemp("bench-tiny"))


def test_the_build_is_the_published_one(built: Path, tmp_path: Path) -> None:
    """With ../shared/bench-tiny present (CI), the build matches the workload's published sha256.
    Without it (a user's clone), a second build matches the first byte for byte, and with the
    pinned versions both match the hashes recorded in benchmarks/bench_tiny.py."""
    hashes = sha256_of(built)
    if WORKLOAD.exists():
        published = _published_hashes(WORKLOAD)
        assert hashes == published == REFERENCE_SHA256
        return
    again = build_assets(tmp_path / "again")
    assert sha256_of(again) == hashes
    for name in ("model/config.json", "tokenizer/tokenizer_config.json"):
        assert (built / name).read_bytes() == (again / name).read_bytes()
    if _pinned_versions():
        assert hashes == REFERENCE_SHA256


def _pinned_versions() -> bool:
    """Whether torch, transformers and tokenizers are constraints.txt's (the reference build's)."""
    import tokenizers
    import torch
    import transformers

    pins = dict(
        line.split("==")
        for line in (Path(__file__).resolve().parents[1] / "constraints.txt").read_text().split()
        if "==" in line
    )
    return (
        torch.__version__.split("+")[0] == pins["torch"]
        and transformers.__version__ == pins["transformers"]
        and tokenizers.__version__ == pins["tokenizers"]
    )


def test_the_build_loads_as_the_workload_describes(built: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(built / "tokenizer"))
    assert tokenizer.encode("12+34=") == [1, 4, 5, 13, 6, 7, 14]
    model = LlamaForCausalLM.from_pretrained(str(built / "model"))
    assert sum(p.numel() for p in model.parameters()) == 2_910_464
    rows = [json.loads(line) for line in (built / "prompts.jsonl").read_text().splitlines()]
    assert rows == prompt_rows() and len(rows) == 1024
    assert rows[:3] == [
        {"prompt": "66+24=", "answer": "90"},
        {"prompt": "10+21=", "answer": "31"},
        {"prompt": "84+14=", "answer": "98"},
    ]
    assert all(len(tokenizer.encode(r["prompt"])) == 7 for r in rows)


def test_prefix_partial_matches_the_workload_definition() -> None:
    assert prefix_partial(P("90"), G("90")) == 1.0
    assert prefix_partial(P("90"), G("9011")) == 1.0  # starts with the answer
    assert prefix_partial(P("123"), G("12")) == pytest.approx(2 / 3)
    assert prefix_partial(P("123"), G("129")) == pytest.approx(2 / 3)
    assert prefix_partial(P("31"), G("11111111")) == 0.0
    assert prefix_partial(P("31"), G("")) == 0.0


def test_prefix_partial_reference_scores() -> None:
    """The workload's reference: "11111111" scores 0.2399 on the 1024 prompts, "1" 0.2100."""
    labels = [row["answer"] for row in prompt_rows()]
    for text, expected in [("11111111", 0.2399), ("1", 0.2100)]:
        mean = sum(prefix_partial(P(label), G(text)) for label in labels) / len(labels)
        assert mean == pytest.approx(expected, abs=5e-5)


@given(label=st.text("0123456789", min_size=1, max_size=4), text=st.text("0123456789", max_size=8))
def test_prefix_partial_is_a_fraction_of_the_label(label: str, text: str) -> None:
    reward = prefix_partial(P(label), G(text))
    assert 0.0 <= reward <= 1.0
    assert (reward == 1.0) == text.startswith(label)
    assert json.dumps(reward)  # a plain float
