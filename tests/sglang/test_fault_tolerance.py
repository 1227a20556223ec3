"""Fault tolerance (``--use-fault-tolerance``) against a real SGLang server on the CPU: a server
killed with every request in flight, one that stops answering, and one that died while idle are
restarted; every request is answered once, by a server holding the weights that were served; one
failure past the restart limit is an error naming it."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import pytest

from rlcore.engines import _shm
from rlcore.errors import RolloutError
from rlcore.samples import Generation, Prompt, SamplingParams
from rlcore.weights import WeightSink, deliver
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.launcher import LaunchSettings
from rlcore_sglang.options import EngineOptions, FaultTolerance
from rlcore_sglang.server import SGLangServer
from tests.sglang.conftest import Weights, shared_memory_files
from tests.sglang.reference import greedy, hf_model
from tests.sglang.test_generate import prompts

pytestmark = pytest.mark.sglang

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


class _Source:
    """A :class:`~rlcore.weights.WeightSource` in this process (a rank's role in a run)."""

    def __init__(self, weights: Weights) -> None:
        self.weights = weights
        self.sent = 0

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        self.sent += 1
        deliver(self.weights.items(), sinks)


def _pid(server: SGLangServer) -> int:
    assert server.process is not None
    return server.process.pid


def _generate_while(
    engine: SGLangEngine, batch: list[Prompt], act: Callable[[], None]
) -> list[Generation]:
    """Generate ``batch`` and ``act`` once every request has reached the server: it is paused
    first, so that it holds them all (none can finish before ``act``)."""
    server = engine.servers[0]
    server.post("/pause_generation", {"mode": "retract"}, timeout_s=60)
    out: list[Generation] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            out.extend(engine.generate(batch, GREEDY))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    deadline = time.monotonic() + 60
    while engine._in_flight < len(batch) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine._in_flight == len(batch)
    act()
    worker.join(timeout=900)
    assert not worker.is_alive()
    assert not errors, errors
    return out


def _wait_gone(paths: set[str]) -> list[str]:
    deadline = time.monotonic() + 30
    while any(Path(p).exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in paths if Path(p).exists()]


def test_failed_servers_are_restarted_with_the_weights_served(
    launch_settings: LaunchSettings, tiny_model: Path, weights_b: Weights, tmp_path: Path
) -> None:
    settings = attrs.evolve(launch_settings, log_dir=tmp_path)
    ft = FaultTolerance(
        max_restarts=3, backoff_s=0.1, health_check_interval_s=0.5, health_check_timeout_s=2.0
    )
    options = EngineOptions(
        max_prompts_per_request=1,
        max_concurrent_requests=4,
        connect_retries=1,
        retry_backoff_s=0.1,
        fault_tolerance=ft,
    )
    batch = prompts(4)
    model_b = hf_model(str(tiny_model), weights_b)
    expected = [greedy(model_b, p.token_ids, GREEDY.max_new_tokens)[0] for p in batch]

    def check(out: list[Generation], version: int) -> None:
        # One answer per prompt, in order, from B's weights (not the model folder's A).
        assert [list(g.token_ids) for g in out] == expected
        assert {g.weight_version for g in out} == {version}

    engine = SGLangEngine.launch(settings, options=options)
    pids = [_pid(engine.servers[0])]
    try:
        source = _Source(weights_b)
        with engine.receive_weights(7) as sinks:
            source.send_weights(sinks)
        engine.restore_weights_from(source)

        # Killed with every request in flight: restarted, given B again, the requests resent.
        first = engine.servers[0]
        debris = {
            f
            for f in shared_memory_files([first])
            if Path(f).name.startswith(("sem.mp-", "sglang_loads_"))
        }
        assert debris
        check(_generate_while(engine, batch, lambda: os.killpg(pids[0], signal.SIGKILL)), 7)
        assert engine.restarts == (1,) and source.sent == 2
        assert engine.servers[0] is not first
        assert _wait_gone(debris) == []
        pids.append(_pid(engine.servers[0]))

        # Stops answering (every process stopped): the health monitor stops it, then the same.
        check(_generate_while(engine, batch, lambda: os.killpg(pids[1], signal.SIGSTOP)), 7)
        assert engine.restarts == (2,) and source.sent == 3
        pids.append(_pid(engine.servers[0]))

        # Died while idle: the next weight update restarts it and gives it the new weights.
        os.killpg(pids[2], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while engine.servers[0].is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        with engine.receive_weights(8) as sinks:
            source.send_weights(sinks)
        assert engine.restarts == (3,) and source.sent == 4  # the update itself, nothing more
        check(engine.generate(batch, GREEDY), 8)
        pids.append(_pid(engine.servers[0]))

        # One failure past the limit ends it, naming the limit and quoting the log.
        os.killpg(pids[3], signal.SIGKILL)
        with pytest.raises(RolloutError, match=r"restarted 3 times \(--max-engine-restarts 3\)"):
            engine.generate(batch, GREEDY)
    finally:
        engine.close()
    for n in (1, 2, 3):  # each restart has its own log; the failed servers' logs are kept
        assert (tmp_path / f"sglang-0.restart{n}.log").is_file()
    left = [(pid, _shm.group_members(pid)) for pid in pids]
    assert all(not members for _, members in left), left
