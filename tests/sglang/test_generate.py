"""Generation through real SGLang servers on the CPU, checked against transformers."""

from __future__ import annotations

import math
import time
from pathlib import Path

import psutil
import pytest

from rlcore.errors import RolloutError
from rlcore.samples import Prompt, SamplingParams
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.options import EngineOptions
from tests.sglang.conftest import Weights
from tests.sglang.reference import greedy, hf_model, score

pytestmark = pytest.mark.sglang

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


def prompts(count: int) -> list[Prompt]:
    """Distinct prompts: <bos> then a few characters (ids 3..41)."""
    return [
        Prompt(index=i, text="", token_ids=(1, 3 + i % 39, 3 + (7 * i) % 39, 3 + (13 * i) % 39))
        for i in range(count)
    ]


def test_greedy_tokens_and_log_probs_match_transformers(
    dp_engine: SGLangEngine, tiny_model: Path, weights_a: Weights
) -> None:
    dp_engine.update_weights(weights_a.items(), version=1)
    batch = prompts(7)
    generations = dp_engine.generate(batch, GREEDY)

    model = hf_model(str(tiny_model), weights_a)
    assert len(generations) == len(batch)
    for prompt, generation in zip(batch, generations, strict=True):
        tokens, log_probs = greedy(model, prompt.token_ids, GREEDY.max_new_tokens)
        assert list(generation.token_ids) == tokens
        assert generation.log_probs == pytest.approx(log_probs, abs=2e-4)
        assert generation.finish_reason == "length"
        assert generation.weight_version == 1


def test_results_come_back_in_prompt_order(dp_engine: SGLangEngine, weights_a: Weights) -> None:
    dp_engine.update_weights(weights_a.items(), version=2)
    batch = prompts(9)
    together = dp_engine.generate(batch, GREEDY)
    alone = [dp_engine.generate([p], GREEDY)[0] for p in reversed(batch)][::-1]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert len({g.token_ids for g in together}) > 1  # the prompts really lead to different answers


def test_both_data_parallel_servers_serve_requests(dp_engine: SGLangEngine) -> None:
    def served(server_log: str | None) -> int:
        assert server_log is not None
        return Path(server_log).read_text(errors="replace").count('"POST /generate HTTP/1.1" 200')

    before = [served(s.log_path) for s in dp_engine.servers]
    dp_engine.generate(prompts(8), GREEDY)  # 4 requests of 2 prompts
    after = [served(s.log_path) for s in dp_engine.servers]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]


def test_sampled_log_probs_are_of_the_tempered_distribution(
    dp_engine: SGLangEngine, tiny_model: Path, weights_a: Weights
) -> None:
    """A launched server's log-probs are of ``softmax(logits / T)``, the whole distribution
    that top-k and top-p then cut (as the trainer scores them), not the untempered one."""
    dp_engine.update_weights(weights_a.items(), version=3)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.95, top_k=20)
    batch = prompts(6)
    generations = dp_engine.generate(batch, params)
    model = hf_model(str(tiny_model), weights_a)
    for prompt, generation in zip(batch, generations, strict=True):
        assert 1 <= len(generation.token_ids) <= params.max_new_tokens
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in generation.log_probs)
        expected = score(model, prompt.token_ids, generation.token_ids, params.temperature)
        assert generation.log_probs == pytest.approx(expected, abs=2e-4)
        untempered = score(model, prompt.token_ids, generation.token_ids)
        assert generation.log_probs != pytest.approx(untempered, abs=1e-3)


def test_stop_token_ends_the_response_and_is_kept(
    dp_engine: SGLangEngine, weights_a: Weights
) -> None:
    dp_engine.update_weights(weights_a.items(), version=4)
    prompt = prompts(1)
    free_run = dp_engine.generate(prompt, GREEDY)[0].token_ids
    stop = free_run[3]
    first = free_run.index(stop)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    generation = dp_engine.generate(prompt, params)[0]
    assert generation.finish_reason == "stop"
    assert generation.token_ids == free_run[: first + 1]
    assert len(generation.log_probs) == len(generation.token_ids)


def test_unknown_sampling_parameter_is_a_clear_error(dp_urls: list[str]) -> None:
    options = EngineOptions(extra_sampling_params={"no_such_knob": 1})
    with SGLangEngine.connect(dp_urls, options) as engine:
        with pytest.raises(RolloutError) as caught:
            engine.generate(prompts(1), GREEDY)
    message = str(caught.value)
    assert "no_such_knob" in message
    assert "rejected a sampling parameter" in message
    assert "extra_sampling_params" in message
    assert dp_urls[0] in message


def test_connected_engine_reads_the_tensor_parallel_size(dp_urls: list[str]) -> None:
    with SGLangEngine.connect(dp_urls) as engine:
        assert engine.tp_sizes == (1, 1)
        assert engine.generate(prompts(2), GREEDY)[1].token_ids


def test_idle_launched_servers_sleep_instead_of_spinning(dp_engine: SGLangEngine) -> None:
    """Launched servers pass ``--sleep-on-idle``: between rollouts (while the trainer runs) an
    idle server's processes block on their sockets. Without it each scheduler spins a core, which
    on a 2-core machine starved the Megatron rank beside it (CI: start-up past its 600 s limit)."""
    dp_engine.generate(prompts(2), GREEDY)  # the servers have just been busy
    processes = []
    for server in dp_engine.servers:
        assert server.process is not None
        parent = psutil.Process(server.process.pid)
        processes += [parent, *parent.children(recursive=True)]

    def cpu_seconds() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    time.sleep(1.0)  # let a just-finished request settle
    before, started = cpu_seconds(), time.monotonic()
    time.sleep(4.0)
    used, elapsed = cpu_seconds() - before, time.monotonic() - started
    # Measured on this machine, one idle server: 1.01 CPU-s per second spinning, 0.02 sleeping
    # (it wakes once a second to poll). Two spinning servers would use up to 2 per second.
    assert used < 0.25 * elapsed, f"idle servers used {used:.2f} CPU-s in {elapsed:.1f} s"
