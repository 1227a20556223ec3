"""Failures of a real server: a kill mid-rollout, a closed engine."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from rlcore.errors import RolloutError
from rlcore.samples import SamplingParams
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import SGLangServer
from tests.sglang.conftest import shared_memory_files
from tests.sglang.test_generate import prompts

pytestmark = pytest.mark.sglang


def test_killed_server_mid_rollout_raises_with_its_log_tail(victim_server: SGLangServer) -> None:
    options = EngineOptions(
        max_prompts_per_request=2, max_concurrent_requests=2, connect_retries=2, retry_backoff_s=0.1
    )
    engine = SGLangEngine([victim_server], options)
    params = SamplingParams(max_new_tokens=100, temperature=1.0)
    assert engine.generate(prompts(2), SamplingParams(max_new_tokens=2))  # alive and serving
    process = victim_server.process
    assert process is not None
    shared_memory = shared_memory_files([victim_server])
    names = sorted(Path(f).name for f in shared_memory)
    assert any(name.startswith("sglang_loads_") for name in names), names  # its load snapshot
    assert any(name.startswith("sem.mp-") for name in names), names  # its scheduler's semaphore

    def kill_soon() -> None:
        time.sleep(1.0)
        os.killpg(process.pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    started = time.monotonic()
    killer.start()
    with pytest.raises(RolloutError) as caught:
        engine.generate(prompts(400), params)
    killer.join()
    message = str(caught.value)
    assert time.monotonic() - started < 60
    assert victim_server.url in message
    assert "exited with code -9" in message
    # The message quotes the end of the killed server's own log, which has stopped growing.
    assert victim_server.log_path is not None
    log_lines = Path(victim_server.log_path).read_text(errors="replace").splitlines()
    quoted = message.split("--- last lines of the server log ---\n", 1)[1].splitlines()
    assert len(log_lines) >= len(quoted) > 0
    assert quoted == log_lines[-len(quoted) :]

    # Afterwards the engine keeps failing fast, and closing it twice is fine.
    with pytest.raises(RolloutError, match="exited with code"):
        engine.generate(prompts(1), params)
    engine.close()
    engine.close()
    with pytest.raises(RolloutError, match="closed"):
        engine.generate(prompts(1), params)

    # What it mapped in /dev/shm goes too, before anyone stops it (its reaper sees it die).
    deadline = time.monotonic() + 30
    while [f for f in shared_memory if Path(f).exists()] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [f for f in shared_memory if Path(f).exists()] == []
