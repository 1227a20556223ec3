"""Two gloo ranks on the CPU: tensor parallel 2 and data parallel 2 agree with one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from rlcore.specs import EvalSpec, ModelSpec
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.model.hf_weights import HFReader
from tests.megatron import multirank_worker
from tests.megatron.helpers import (
    TOKEN_MEAN_TIS,
    assert_same_step,
    gradient_step_spec,
    make_batch,
    make_samples,
    run_two_ranks,
    train_spec,
    weights,
)

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_ranks(tiny_hf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    run_two_ranks(multirank_worker.run, str(tiny_hf), str(out), timeout=300)
    return out


def _load(out: Path, name: str, rank: int) -> dict[str, Any]:
    result: dict[str, Any] = torch.load(out / f"{name}.rank{rank}.pt")
    return result


def _single_process_step(hf: Path) -> tuple[dict[str, torch.Tensor], float]:
    stack = MegatronBackend().build_training_stack(gradient_step_spec(hf))
    metrics = stack.train_step(make_batch(make_samples(4, seed=21), seed=22))
    return weights(stack.export_weights()), metrics.grad_norm


def test_tensor_parallel_export_gathers_the_full_weights(two_ranks: Path, tiny_hf: Path) -> None:
    hf_state = transformers.LlamaForCausalLM.from_pretrained(tiny_hf).state_dict()
    for rank in range(2):
        exported = _load(two_ranks, "tp2", rank)["exported"]
        assert exported.keys() == hf_state.keys()
        for name, tensor in exported.items():
            assert torch.equal(tensor, hf_state[name]), name


def test_tensor_parallel_save_hf_writes_a_loadable_checkpoint(
    two_ranks: Path, tiny_hf: Path
) -> None:
    saved = transformers.LlamaForCausalLM.from_pretrained(two_ranks / "tp2_hf").state_dict()
    original = transformers.LlamaForCausalLM.from_pretrained(tiny_hf).state_dict()
    assert saved.keys() == original.keys()
    for name, tensor in saved.items():
        assert torch.equal(tensor, original[name]), name


def test_tensor_parallel_log_probs_match_one_process(two_ranks: Path, tiny_hf: Path) -> None:
    single = MegatronBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tiny_hf)))
    expected = single.forward(make_samples(4, seed=21))
    for rank in range(2):
        got = _load(two_ranks, "tp2", rank)["log_probs"]
        for x, y in zip(got, expected, strict=True):
            assert x == pytest.approx(y, abs=1e-5)


def test_tensor_parallel_bf16_log_probs_match_one_process(two_ranks: Path, tiny_hf: Path) -> None:
    spec = EvalSpec(ModelSpec("actor", tiny_hf, precision="bfloat16"))
    expected = MegatronBackend().build_eval_stack(spec).forward(make_samples(4, seed=21))
    for rank in range(2):
        got = _load(two_ranks, "tp2", rank)["bf16_log_probs"]
        for x, y in zip(got, expected, strict=True):
            assert x == pytest.approx(y, abs=0.02)  # bf16 sums split over two ranks


@pytest.mark.parametrize("name", ["tp2", "dp2"])
def test_two_rank_train_step_matches_one_process(two_ranks: Path, tiny_hf: Path, name: str) -> None:
    expected, grad_norm = _single_process_step(tiny_hf)
    original = HFReader(tiny_hf)
    for rank in range(2):
        result = _load(two_ranks, name, rank)
        assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
        for key, tensor in result["trained"].items():
            assert_same_step(tensor, expected[key], original.get(key), key)


@pytest.mark.parametrize("name", ["dp2_token", "dp2_budget"])
def test_token_mean_loss_over_two_data_parallel_ranks_matches_one_process(
    two_ranks: Path, tiny_hf: Path, name: str
) -> None:
    """The token-mean normaliser is the *global* token count: two replicas, each with half the
    batch (contiguous halves, or length-balanced shares cut by a token budget), take the update
    and report the metrics of one process with all of it."""
    stack = MegatronBackend().build_training_stack(gradient_step_spec(tiny_hf, loss=TOKEN_MEAN_TIS))
    metrics = stack.train_step(make_batch(make_samples(4, seed=21), seed=22, rollout=True))
    expected = weights(stack.export_weights())
    original = HFReader(tiny_hf)
    for rank in range(2):
        result = _load(two_ranks, name, rank)
        assert result["grad_norm"] == pytest.approx(metrics.grad_norm, rel=1e-4)
        assert result["loss"] == pytest.approx(metrics.loss, rel=1e-5)
        for key in ("tis_weight", "tis_clipfrac", "logprob_mismatch", "logprob_mismatch_max"):
            assert result["extra"][key] == pytest.approx(metrics.extra[key], rel=1e-5), key
        for key, tensor in result["trained"].items():
            assert_same_step(tensor, expected[key], original.get(key), key)


def test_tensor_parallel_checkpoint_round_trip(two_ranks: Path) -> None:
    assert [_load(two_ranks, "tp2", r)["loaded"] for r in range(2)] == [4, 4]


def test_data_parallel_replicas_report_global_metrics(two_ranks: Path) -> None:
    a, b = (_load(two_ranks, "dp2", r) for r in range(2))
    assert (
        a["tokens"]
        == b["tokens"]
        == sum(len(s.response.token_ids) for s in make_samples(4, seed=21))
    )
    assert a["loss"] == pytest.approx(b["loss"])


def test_ranks_that_load_different_rollout_ids_raise(two_ranks: Path) -> None:
    for rank in range(2):
        message = _load(two_ranks, "dp2", rank)["disagreement"]
        assert "disagree" in message and "dp2_" in message


def test_distributed_optimizer_in_bf16_over_two_ranks(two_ranks: Path, tiny_hf: Path) -> None:
    # One process with the replicated mixed-precision optimizer takes the same step (up to the
    # order of fp32 gradient sums, which can move a bf16 weight by one rounding step).
    single = MegatronBackend().build_training_stack(train_spec(tiny_hf, precision="bfloat16"))
    metrics = single.train_step(make_batch(make_samples(4, seed=21), seed=22))
    expected = weights(single.export_weights())
    results = [_load(two_ranks, "dp2_zero1", rank) for rank in range(2)]
    for result in results:
        assert result["optimizer"] == ["DistributedOptimizer"]
        assert result["grad_norm"] == pytest.approx(metrics.grad_norm, rel=1e-4)
        for key, tensor in result["one_step"].items():
            assert tensor.dtype == torch.bfloat16
            torch.testing.assert_close(tensor, expected[key], rtol=1e-2, atol=1e-4, msg=key)
    # Both ranks hold the same (all-gathered) weights, and resuming from the sharded checkpoint
    # into fresh stacks is bit-identical to not stopping.
    for key in results[0]["straight"]:
        assert torch.equal(results[0]["straight"][key], results[1]["straight"][key]), key
        for result in results:
            assert torch.equal(result["resumed"][key], result["straight"][key]), key
