"""A bf16 SGLang server (what ``--bf16`` launches) takes a bf16 trainer's weights unconverted, by
every sync mode, from the driver and from a bf16 Megatron rank, and decodes as transformers does
in bf16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch

from rlcore.launch.ray.stacks import RayBackend, RayEvalStack
from rlcore.loop import push_weights
from rlcore.samples import SamplingParams
from rlcore.specs import EvalSpec, ModelSpec
from rlcore_megatron.kind import MegatronRuntime
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.launcher import LaunchSettings
from rlcore_sglang.options import EngineOptions, WeightSyncMode
from tests.sglang.conftest import Weights
from tests.sglang.reference import greedy, hf_model
from tests.sglang.test_generate import prompts

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)
# bf16 logits of the peaked test model reach ~10, so log-probs of two bf16 implementations
# differ by a few hundredths (measured: at most 0.053).
LOG_PROB_TOL = 0.1


@pytest.fixture(scope="module")
def bf16_urls(launch_settings: LaunchSettings) -> Iterator[list[str]]:
    settings = attrs.evolve(launch_settings, dtype="bfloat16")
    with SGLangEngine.launch(settings, num_servers=1) as engine:
        yield [server.url for server in engine.servers]


@pytest.fixture(scope="module")
def bf16_rank(tiny_model_b: Path, ray_cluster: None) -> Iterator[RayEvalStack]:
    """One Megatron rank holding weights B in bf16 (the server starts with A)."""
    with RayBackend(MegatronRuntime()) as backend:
        yield backend.build_eval_stack(
            EvalSpec(ModelSpec("actor", tiny_model_b, precision="bfloat16"))
        )


def _bf16(weights: Weights) -> Weights:
    """Weights as a ``--bf16`` trainer exports them."""
    return {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}


def _options(mode: WeightSyncMode, sync_dir: Path) -> EngineOptions:
    return EngineOptions(
        weight_sync=mode,
        bucket_bytes=40_000,  # several buckets
        sync_dir=sync_dir if mode == "disk" else None,
        weight_sync_timeout_s=120.0,
    )


def _assert_serves_bf16(engine: SGLangEngine, tiny_model: Path, weights: Weights) -> None:
    reference = hf_model(str(tiny_model), weights)
    # functools.wraps on PreTrainedModel.to hides its real signature from mypy.
    reference.to(torch.bfloat16)  # type: ignore[arg-type]
    batch = prompts(6)
    for prompt, generation in zip(batch, engine.generate(batch, GREEDY), strict=True):
        tokens, log_probs = greedy(reference, prompt.token_ids, GREEDY.max_new_tokens)
        assert list(generation.token_ids) == tokens
        assert generation.log_probs == pytest.approx(log_probs, abs=LOG_PROB_TOL)


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_bf16_server_serves_synced_bf16_weights(
    mode: WeightSyncMode,
    bf16_urls: list[str],
    tiny_model: Path,
    weights_b: Weights,
    tmp_path: Path,
) -> None:
    weights = _bf16(weights_b)  # not the weights the server started with
    with SGLangEngine.connect(bf16_urls, _options(mode, tmp_path)) as engine:
        engine.update_weights(weights.items(), version=41)
        _assert_serves_bf16(engine, tiny_model, weights)
        assert engine.weight_version == 41


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_a_bf16_rank_sends_its_weights_to_a_bf16_server(
    mode: WeightSyncMode,
    bf16_rank: RayEvalStack,
    bf16_urls: list[str],
    tiny_model: Path,
    weights_a: Weights,
    weights_b: Weights,
    tmp_path: Path,
) -> None:
    with SGLangEngine.connect(bf16_urls) as engine:  # back to A, from the driver
        engine.update_weights(_bf16(weights_a).items(), version=60)
    with SGLangEngine.connect(bf16_urls, _options(mode, tmp_path)) as engine:
        push_weights(bf16_rank, engine, version=61)
        assert engine.weight_version == 61
        _assert_serves_bf16(engine, tiny_model, _bf16(weights_b))
