"""Each weight-sync mode really changes what the servers generate, and to the right weights."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlcore.samples import SamplingParams
from rlcore_sglang import server_loader
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.launcher import LaunchSettings
from rlcore_sglang.options import EngineOptions, WeightSyncMode
from rlcore_sglang.server import SGLangServer
from rlcore_sglang.weight_sync.tensor import release_shared_buffers
from tests.sglang.conftest import Weights, mapped_files
from tests.sglang.reference import greedy, hf_model
from tests.sglang.test_generate import prompts

pytestmark = pytest.mark.sglang

GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0)


def assert_serves(engine: SGLangEngine, tiny_model: Path, weights: Weights, version: int) -> None:
    """Every prompt (spread over both servers) decodes as transformers does with ``weights``."""
    batch = prompts(6)
    generations = engine.generate(batch, GREEDY)
    model = hf_model(str(tiny_model), weights)
    for prompt, generation in zip(batch, generations, strict=True):
        tokens, log_probs = greedy(model, prompt.token_ids, GREEDY.max_new_tokens)
        assert list(generation.token_ids) == tokens
        assert generation.log_probs == pytest.approx(log_probs, abs=2e-4)
        assert generation.weight_version == version


@pytest.mark.parametrize(
    ("mode", "bucket_bytes"),
    [
        ("tensor", 512 * 1024**2),
        ("tensor", 40_000),  # several buckets, one shared-memory buffer reused
        ("distributed", 512 * 1024**2),
        ("distributed", 40_000),
        ("disk", 512 * 1024**2),
    ],
)
def test_update_weights_switches_the_served_model(
    mode: WeightSyncMode,
    bucket_bytes: int,
    dp_urls: list[str],
    tiny_model: Path,
    weights_a: Weights,
    weights_b: Weights,
    tmp_path: Path,
) -> None:
    options = EngineOptions(
        weight_sync=mode,
        bucket_bytes=bucket_bytes,
        max_prompts_per_request=1,
        sync_dir=tmp_path if mode == "disk" else None,
        weight_sync_timeout_s=120.0,
    )
    with SGLangEngine.connect(dp_urls, options) as engine:
        engine.update_weights(weights_b.items(), version=11)
        assert engine.weight_version == 11
        assert_serves(engine, tiny_model, weights_b, version=11)
        # A second sync in the same engine (the group / buffer / folder is reused), back to A.
        engine.update_weights(weights_a.items(), version=12)
        assert_serves(engine, tiny_model, weights_a, version=12)
    if mode == "disk":
        assert [p.name for p in tmp_path.iterdir()] == ["weights-v12"]


def test_models_really_differ(tiny_model: Path, weights_a: Weights, weights_b: Weights) -> None:
    """Guards the test above: A and B decode differently, so a sync that did nothing would fail."""
    first = prompts(1)[0].token_ids
    a = greedy(hf_model(str(tiny_model), weights_a), first, GREEDY.max_new_tokens)[0]
    b = greedy(hf_model(str(tiny_model), weights_b), first, GREEDY.max_new_tokens)[0]
    assert a != b


def test_update_from_an_exported_folder(
    dp_urls: list[str], tiny_model: Path, weights_b: Weights, tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in weights_b.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with SGLangEngine.connect(dp_urls, EngineOptions(weight_sync="tensor")) as engine:
        engine.update_weights_from_disk(tmp_path, version=21)
        assert_serves(engine, tiny_model, weights_b, version=21)


def test_generation_after_sync_uses_no_stale_cache(
    dp_engine: SGLangEngine, weights_a: Weights, weights_b: Weights
) -> None:
    """The same prompt twice around a sync: the second answer comes from the new weights, not
    from the prefix cache the old ones filled."""
    prompt = prompts(1)
    dp_engine.update_weights(weights_a.items(), version=31)
    before = dp_engine.generate(prompt * 2, GREEDY)
    dp_engine.update_weights(weights_b.items(), version=33)
    after = dp_engine.generate(prompt * 2, GREEDY)
    assert before[0].token_ids != after[0].token_ids
    assert {g.weight_version for g in after} == {33}


def test_servers_with_rlcore_loader_keep_their_mappings_between_tensor_syncs(
    dp_engine: SGLangEngine,
    dp_urls: list[str],
    tiny_model: Path,
    weights_a: Weights,
    weights_b: Weights,
) -> None:
    """Launched servers register rlcore_sglang.server_loader and a connected engine finds it: the
    shared memory a sync sent stays mapped in the servers and the next sync reuses it (nothing is
    mapped anew). With SGLang's own loading (an engine that does not name the loader) nothing of
    a sync stays mapped; both load the right weights."""
    options = EngineOptions(weight_sync="tensor", max_prompts_per_request=1)
    ours = (
        f"/dev/shm/torch_{os.getpid()}_"  # this process's shared buffers, as the servers map them
    )
    with (
        SGLangEngine([SGLangServer(url) for url in dp_urls], options) as plain,
        SGLangEngine.connect(dp_urls, options) as keeping,
    ):
        release_shared_buffers()  # this process's next sync sends new segments
        before = mapped_files(dp_engine.servers, ours)
        plain.update_weights(weights_b.items(), version=41)
        assert_serves(plain, tiny_model, weights_b, version=41)
        assert mapped_files(dp_engine.servers, ours) == before

        keeping.update_weights(weights_a.items(), version=42)
        assert_serves(keeping, tiny_model, weights_a, version=42)
        kept = mapped_files(dp_engine.servers, ours) - before
        assert kept
        keeping.update_weights(weights_b.items(), version=43)
        assert_serves(keeping, tiny_model, weights_b, version=43)
        assert mapped_files(dp_engine.servers, ours) - before == kept


def test_only_an_interpreter_known_to_import_it_is_given_rlcore_loader(tiny_model: Path) -> None:
    """SGLang imports a custom loader at the first update and dies if it cannot: by default the
    loader is named only for servers run by this interpreter, which imports it."""
    this = LaunchSettings(tiny_model).command("127.0.0.1", 30000)
    other = LaunchSettings(tiny_model, python="/opt/other/bin/python").command("127.0.0.1", 30000)
    assert this[this.index("--custom-weight-loader") + 1] == server_loader.NAME
    assert "--custom-weight-loader" not in other
