"""Each model family served by a real SGLang server on the CPU from the folder ``save_hf``
writes: greedy tokens and log-probs equal transformers', before and after a weight update under
the published checkpoint names (one tensor per expert for Qwen3-MoE).

The four servers (one per family, about 1.7 GB each) start together, since start-up is mostly
imports, and stop when this module's tests are done.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlcore.engines.hosts import LocalProcessHost
from rlcore.samples import Prompt, SamplingParams
from rlcore_megatron.model.arch import read_hf_config
from rlcore_megatron.model.hf_weights import HFReader, save_hf
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.launcher import LaunchSettings, start_server
from rlcore_sglang.server import SGLangServer
from tests.families import (
    ALPHABET,
    FAMILIES,
    Family,
    build_family_model,
    greedy_reference,
    tiny_config,
)
from tests.sglang.conftest import STARTUP_TIMEOUT_S, shared_memory_files

pytestmark = pytest.mark.sglang

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
PROMPTS = [Prompt(i, "", (1, 3 + i, 3 + (7 * i) % 39, 3 + (13 * i) % 39)) for i in range(3)]


def _saved(source: Path, out: Path) -> Path:
    """``source``'s tensors written by ``save_hf`` (config from the family's rules), with the
    tokenizer beside them."""
    reader = HFReader(source)
    save_hf(
        ((name, reader.get(name)) for name in sorted(reader.names())), out, read_hf_config(source)
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def _assert_serves_like_transformers(
    engine: SGLangEngine, reference: Path, version: int | None = None
) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(reference), dtype=torch.float32)
    for prompt, generation in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        tokens, log_probs = greedy_reference(model, prompt.token_ids, GREEDY.max_new_tokens)
        assert list(generation.token_ids) == tokens
        assert generation.log_probs == pytest.approx(log_probs, abs=2e-4)
        assert version is None or generation.weight_version == version


@pytest.fixture(scope="module")
def family_servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[Family, tuple[SGLangServer, Path]]]:
    """Per family: a launched server on ``save_hf``'s folder, and that folder."""
    servers: dict[Family, tuple[SGLangServer, Path]] = {}
    try:
        for index, family in enumerate(FAMILIES):
            root = tmp_path_factory.mktemp(family)
            source = build_family_model(
                root / "source", tiny_config(family), peaked=True, alphabet=ALPHABET
            )
            served = _saved(source, root / "served")
            settings = LaunchSettings(
                model_path=served,
                device="cpu",
                dtype="float32",
                max_total_tokens=2048,
                startup_timeout_s=STARTUP_TIMEOUT_S,
                log_dir=root / "logs",
                env={"OMP_NUM_THREADS": "1"},
            )
            servers[family] = (start_server(settings, LocalProcessHost(), index=index), served)
        for server, _ in servers.values():
            server.wait_until_healthy(STARTUP_TIMEOUT_S)
        yield servers
    finally:
        for server, _ in servers.values():
            server.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_sglang_serves_the_saved_folder_and_takes_its_weights(
    family: Family,
    family_servers: dict[Family, tuple[SGLangServer, Path]],
    tmp_path: Path,
) -> None:
    server, served = family_servers[family]
    other = build_family_model(tmp_path / "other", tiny_config(family), seed=1, peaked=True)
    with SGLangEngine.connect([server.url]) as engine:
        _assert_serves_like_transformers(engine, served)  # the weights it loaded
        reader = HFReader(other)
        engine.update_weights([(name, reader.get(name)) for name in reader.names()], version=2)
        _assert_serves_like_transformers(engine, other, version=2)


def test_a_stopped_server_leaves_nothing_in_shared_memory(
    family_servers: dict[Family, tuple[SGLangServer, Path]],
) -> None:
    """After this module's other tests (it stops one of their servers): SGLang's processes are
    killed, so what they map in /dev/shm (its load-snapshot file, which SGLang never unlinks, and
    the scheduler's semaphore, which its killed resource tracker would have unlinked) is removed
    by the stop."""
    server, _ = family_servers[FAMILIES[-1]]
    files = shared_memory_files([server])
    names = [Path(f).name for f in files]
    assert any(name.startswith("sglang_loads_") for name in names), names
    assert any(name.startswith("sem.mp-") for name in names), names
    server.shutdown()
    assert [f for f in files if Path(f).exists()] == []
