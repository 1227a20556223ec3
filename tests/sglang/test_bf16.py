"""A bf16 SGLang server (what ``--bf16`` launches) takes the trainer's bf16 weights unconverted,
by every sync mode, and decodes as transformers does in bf16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import torch

from rlcore.engines.sglang import EngineOptions, LaunchSettings, SGLangEngine, WeightSyncMode
from rlcore.samples import SamplingParams
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


def _bf16(weights: Weights) -> Weights:
    """Weights as a ``--bf16`` trainer exports them."""
    return {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_bf16_server_serves_synced_bf16_weights(
    mode: WeightSyncMode,
    bf16_urls: list[str],
    tiny_model: Path,
    weights_b: Weights,
    tmp_path: Path,
) -> None:
    options = EngineOptions(
        weight_sync=mode,
        sync_dir=tmp_path if mode == "disk" else None,
        weight_sync_timeout_s=120.0,
    )
    weights = _bf16(weights_b)  # not the weights the server started with
    reference = hf_model(str(tiny_model), weights)
    # functools.wraps on PreTrainedModel.to hides its real signature from mypy.
    reference.to(torch.bfloat16)  # type: ignore[arg-type]
    with SGLangEngine.connect(bf16_urls, options) as engine:
        engine.update_weights(weights.items(), version=41)
        batch = prompts(6)
        for prompt, generation in zip(batch, engine.generate(batch, GREEDY), strict=True):
            tokens, log_probs = greedy(reference, prompt.token_ids, GREEDY.max_new_tokens)
            assert list(generation.token_ids) == tokens
            assert generation.log_probs == pytest.approx(log_probs, abs=LOG_PROB_TOL)
            assert generation.weight_version == 41
