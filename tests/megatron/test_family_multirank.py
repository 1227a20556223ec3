"""Each model family on two gloo ranks: tensor parallel 2 (and, for Qwen3-MoE, expert parallel 2)
gives transformers' logits, exports the published checkpoint's tensors, and trains exactly as one
process does. Tensor parallel 2 pads Qwen's 151,936-token vocabulary; Qwen3-MoE under tensor
parallelism runs with sequence parallelism (11 tokens pad to 12)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.model.arch import read_hf_config
from rlcore_megatron.model.gpt import uses_sequence_parallel
from rlcore_megatron.model.hf_weights import HFReader
from tests.families import FAMILIES, Family, FamilyModels
from tests.megatron import family_worker
from tests.megatron.helpers import (
    assert_same_step,
    make_batch,
    make_samples,
    run_two_ranks,
    weights,
)

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def folders(family_models: FamilyModels) -> dict[Family, Path]:
    return {family: family_models.folder(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def two_ranks(folders: dict[Family, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("family_ranks")
    run_two_ranks(family_worker.run, {f: str(p) for f, p in folders.items()}, str(out))
    return out


def _results(out: Path, layout: str, family: Family) -> list[dict[str, Any]]:
    return [torch.load(out / f"{layout}.rank{rank}.pt")[family] for rank in range(2)]


def _single_process_step(folder: Path) -> tuple[dict[str, torch.Tensor], float, dict[str, float]]:
    stack = MegatronBackend().build_training_stack(family_worker.family_train_spec(folder))
    metrics = stack.train_step(make_batch(make_samples(4, seed=21), seed=22))
    return weights(stack.export_weights()), metrics.grad_norm, dict(metrics.extra)


def test_two_rank_layouts_of_each_family(folders: dict[Family, Path]) -> None:
    """What the ranks do, stated where a reader looks first."""
    qwen = read_hf_config(folders["qwen2"])
    assert qwen.padded_vocab_size(2) > qwen.vocab_size  # TP 2 pads the vocabulary
    assert uses_sequence_parallel(read_hf_config(folders["qwen3_moe"]), 2)
    assert not uses_sequence_parallel(read_hf_config(folders["qwen3"]), 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_logits_equal_transformers(
    family: Family, folders: dict[Family, Path], two_ranks: Path
) -> None:
    folder = folders[family]
    arch = read_hf_config(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = hf(family_worker.tokens(arch.vocab_size)).logits
    for result in _results(two_ranks, "tp2", family):
        torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("layout", "family"), [*(("tp2", f) for f in FAMILIES), ("ep2", "qwen3_moe")]
)
def test_export_gathers_the_published_tensors(
    layout: str, family: Family, folders: dict[Family, Path], two_ranks: Path
) -> None:
    original = HFReader(folders[family])
    for result in _results(two_ranks, layout, family):
        exported = result["exported"]
        assert exported.keys() == original.names()
        for name, tensor in exported.items():
            assert torch.equal(tensor, original.get(name)), name


@pytest.mark.parametrize(
    ("layout", "family"), [*(("tp2", f) for f in FAMILIES), ("ep2", "qwen3_moe")]
)
def test_two_rank_train_step_matches_one_process(
    layout: str, family: Family, folders: dict[Family, Path], two_ranks: Path
) -> None:
    expected, grad_norm, extra = _single_process_step(folders[family])
    original = HFReader(folders[family])
    for result in _results(two_ranks, layout, family):
        assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
        for name, tensor in result["trained"].items():
            assert_same_step(tensor, expected[name], original.get(name), name)
        if family == "qwen3_moe":  # the router's loss, reduced over ranks, is the same number
            assert result["extra"]["load_balancing_loss"] == pytest.approx(
                extra["load_balancing_loss"], rel=1e-5
            )


def test_expert_parallel_logits_equal_one_process(
    folders: dict[Family, Path], two_ranks: Path
) -> None:
    """Expert parallel 1 (the tensor parallel run: every rank holds all 16 experts) and 2 (each
    rank holds 8) give the same logits."""
    tp2 = _results(two_ranks, "tp2", "qwen3_moe")
    for result in _results(two_ranks, "ep2", "qwen3_moe"):
        torch.testing.assert_close(result["logits"], tp2[0]["logits"], rtol=1e-5, atol=1e-5)


def test_expert_parallel_checkpoint_round_trip(two_ranks: Path) -> None:
    ranks = _results(two_ranks, "ep2", "qwen3_moe")
    assert [r["loaded"] for r in ranks] == [3, 3]
    for result in ranks:
        assert result["reloaded"].keys() == result["trained"].keys()
        for name, tensor in result["reloaded"].items():
            assert torch.equal(tensor, result["trained"][name]), name
    meta = json.loads((two_ranks / "ep2_ckpt" / "rollout.json").read_text())
    assert meta["rollout_id"] == 3
