"""Weights from a Megatron rank (a Ray actor) straight into real SGLang servers, in every mode: the
driver opens the update and ships the engine's sinks to the rank, which sends; the servers end up
serving exactly the rank's weights, and nothing of the transfer happens in the driver."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rlcore.launch.ray.stacks import RayBackend, RayEvalStack
from rlcore.loop import push_weights
from rlcore.specs import EvalSpec, ModelSpec
from rlcore_megatron.kind import MegatronRuntime
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.options import EngineOptions, WeightSyncMode
from rlcore_sglang.weight_sync import distributed, tensor
from tests.sglang.conftest import Weights
from tests.sglang.test_weight_sync import assert_serves

pytestmark = [pytest.mark.sglang, pytest.mark.ray, pytest.mark.megatron]


@pytest.fixture(scope="module")
def rank_stack(tiny_model_b: Path, ray_cluster: None) -> Iterator[RayEvalStack]:
    """One Megatron rank holding weights B (the servers start with A)."""
    with RayBackend(MegatronRuntime()) as backend:
        yield backend.build_eval_stack(EvalSpec(ModelSpec("actor", tiny_model_b)))


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_a_rank_sends_its_weights_to_the_servers(
    mode: WeightSyncMode,
    rank_stack: RayEvalStack,
    dp_urls: list[str],
    tiny_model: Path,
    weights_a: Weights,
    weights_b: Weights,
    tmp_path: Path,
) -> None:
    with SGLangEngine.connect(dp_urls) as engine:  # back to A, from the driver
        engine.update_weights(weights_a.items(), version=50)
    options = EngineOptions(
        weight_sync=mode,
        bucket_bytes=40_000,  # several buckets
        max_prompts_per_request=1,
        sync_dir=tmp_path if mode == "disk" else None,
        weight_sync_timeout_s=120.0,
    )
    with SGLangEngine.connect(dp_urls, options) as engine:
        push_weights(rank_stack, engine, version=51)
        assert engine.weight_version == 51
        assert_serves(engine, tiny_model, weights_b, version=51)
        # The transfer ran in the rank: no shared-memory buffer, no broadcast group here.
        assert tensor._SHARED.buffers == (None, None)
        assert distributed._SENDERS == {}
        push_weights(rank_stack, engine, version=52)  # again: the rank reuses its buffers/group
        assert_serves(engine, tiny_model, weights_b, version=52)
    if mode == "disk":
        assert [p.name for p in tmp_path.iterdir()] == ["weights-v52"]
        shards = sorted(p.name for p in (tmp_path / "weights-v52").iterdir())
        assert len(shards) > 2 and shards[-1] == "model.safetensors.index.json"
