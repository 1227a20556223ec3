"""Partial rollouts against real SGLang servers: new weights that arrive mid-generation pause the
servers (retract mode), and every request goes on from the tokens it had, with the new weights."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rlcore.samples import Generation, SamplingParams
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.options import EngineOptions
from tests.sglang.conftest import Weights
from tests.sglang.reference import greedy, hf_model
from tests.sglang.test_generate import prompts

pytestmark = pytest.mark.sglang

LONG = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)


def test_new_weights_mid_generation_go_on_from_the_tokens_made(
    dp_urls: list[str], tiny_model: Path, weights_a: Weights, weights_b: Weights
) -> None:
    batch = prompts(8)
    # Every request is sent at once, so all are in flight when the update comes (with fewer at a
    # time, the ones sent after it start with the new version: handled below, but then whether
    # any request switches mid-way depends on timing).
    options = EngineOptions(
        weight_sync="tensor", max_prompts_per_request=1, max_concurrent_requests=len(batch)
    )
    with SGLangEngine.connect(dp_urls, options) as engine:
        engine.update_weights(weights_a.items(), version=50)
        out: list[Generation] = []
        # The servers hold every request until all are sent (paused servers queue new requests),
        # so none can finish before the update: counting requests in flight on running servers
        # raced requests that finished before the last ones were sent, on a loaded machine.
        _on_all(engine, "/pause_generation", {"mode": "retract"})
        worker = threading.Thread(target=lambda: out.extend(engine.generate(batch, LONG)))
        worker.start()
        deadline = time.monotonic() + 60
        while engine._in_flight < len(batch) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine._in_flight == len(batch)
        # A few decode steps with A before the update (100 tokens take far longer than this).
        _on_all(engine, "/continue_generation", {})
        time.sleep(0.05)
        assert worker.is_alive()
        with engine.receive_weights_interrupting(51) as sinks:
            for sink in sinks:
                sink.receive(weights_b.items())
        worker.join(timeout=300)
        assert engine.weight_version == 51
    assert len(out) == len(batch)
    model_a = hf_model(str(tiny_model), weights_a)
    model_b = hf_model(str(tiny_model), weights_b)
    switched = 0
    for prompt, generation in zip(batch, out, strict=True):
        assert len(generation.token_ids) == LONG.max_new_tokens
        # Stamped when sent: a request dispatched before the update counts as the old version.
        assert generation.first_weight_version in (50, 51)
        assert generation.weight_version in (generation.first_weight_version, 51)
        tokens = list(generation.token_ids)
        if generation.first_weight_version == 51:  # sent after the update: B's tokens only
            assert tokens == greedy(model_b, prompt.token_ids, LONG.max_new_tokens)[0]
            continue
        before = greedy(model_a, prompt.token_ids, LONG.max_new_tokens)[0]
        if generation.weight_version == 50:
            assert tokens == before
            continue
        switched += 1
        # Up to the switch, A's greedy tokens; after it, B's, continuing from those tokens.
        k = next((i for i, (t, a) in enumerate(zip(tokens, before, strict=True)) if t != a), 0)
        after = greedy(model_b, [*prompt.token_ids, *tokens[:k]], min(10, len(tokens) - k))[0]
        assert tokens[k : k + len(after)] == after
    assert switched > 0


def _on_all(engine: SGLangEngine, path: str, payload: dict[str, object]) -> None:
    for server in engine.servers:
        server.post(path, payload, timeout_s=60)
