"""Engine behaviour that needs no SGLang install: bounded waits, clear errors, options."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rlcore.engines.hosts import LocalProcessHost
from rlcore.errors import RolloutError
from rlcore.samples import Prompt, SamplingParams
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.launcher import LaunchSettings, start_server
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import ServerUnreachableError, SGLangServer, free_port


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_connect_to_nothing_times_out_naming_the_url() -> None:
    url = dead_url()
    started = time.monotonic()
    with pytest.raises(RolloutError, match="was not healthy after 1 s") as caught:
        SGLangEngine.connect([url], EngineOptions(health_timeout_s=1.0))
    assert url in str(caught.value)
    assert time.monotonic() - started < 10


def test_generate_retries_with_backoff_then_raises() -> None:
    url = dead_url()
    options = EngineOptions(connect_retries=2, retry_backoff_s=0.2)
    engine = SGLangEngine([SGLangServer(url)], options)
    started = time.monotonic()
    with pytest.raises(RolloutError) as caught:
        engine.generate([Prompt(0, "", (1, 2))], SamplingParams(max_new_tokens=1))
    elapsed = time.monotonic() - started
    assert url in str(caught.value)
    assert "gave up after 3 attempts" in str(caught.value)
    assert 0.2 + 0.4 <= elapsed < 10  # two backoffs happened, nothing hung


def test_launch_with_a_python_without_sglang_reports_the_log(tmp_path: Path) -> None:
    settings = LaunchSettings(
        model_path=tmp_path,
        python=sys.executable,
        env={"PYTHONPATH": str(tmp_path)},  # no sglang here -> the process exits at once
        extra_args=(),
        log_dir=tmp_path / "logs",
        startup_timeout_s=60,
    )
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "launch_server.py").write_text(
        "import sys\nprint('boom: no real server here', file=sys.stderr)\nsys.exit(3)\n"
    )
    with pytest.raises(RolloutError) as caught:
        SGLangEngine.launch(settings, num_servers=2)
    message = str(caught.value)
    assert "exited with code 3" in message
    assert "boom: no real server here" in message


def test_launch_command_binds_the_host_and_caps_the_kv_pool(tmp_path: Path) -> None:
    settings = LaunchSettings(model_path=tmp_path)
    assert LocalProcessHost().address == "127.0.0.1"  # this machine: loopback only
    cmd = settings.command("127.0.0.1", 30001)
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--max-total-tokens") + 1] == "8192"
    assert cmd[cmd.index("--device") + 1] == "cpu"
    assert "--base-gpu-id" not in cmd and "--mem-fraction-static" not in cmd
    assert "--sleep-on-idle" in cmd
    assert "--sleep-on-idle" not in LaunchSettings(
        model_path=tmp_path, sleep_on_idle=False
    ).command("127.0.0.1", 1)
    env = settings.environment(cpus=3)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"  # log-probs of the tempered policy
    assert env["HF_HUB_OFFLINE"] == "1"  # a local model folder: never a model hub lookup
    assert env["OMP_NUM_THREADS"] == "3"  # the host's share of its CPUs
    # A GPU host: tensor parallel over its GPUs, starting at the first one.
    gpu = LaunchSettings(model_path=tmp_path, device="cuda", mem_fraction_static=0.4)
    cmd = gpu.command("10.0.0.2", 30002, base_gpu_id=2, tp_size=2)
    assert cmd[cmd.index("--base-gpu-id") + 1] == "2" and cmd[cmd.index("--tp-size") + 1] == "2"
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.4"
    assert "SGLANG_USE_CPU_ENGINE" not in gpu.environment()


def test_a_host_whose_gpus_are_not_consecutive_is_refused(tmp_path: Path) -> None:
    host = LocalProcessHost(gpu_ids=(0, 2))
    settings = LaunchSettings(model_path=tmp_path, device="cuda")
    with pytest.raises(RolloutError, match=r"GPUs \[0, 2\] on 127.0.0.1 are not consecutive"):
        start_server(settings, host)


def test_options_reject_nonsense() -> None:
    with pytest.raises(ValueError, match="weight_sync"):
        # The point of the test: a mode mypy would reject still fails loudly at run time.
        EngineOptions(weight_sync="carrier-pigeon")  # type: ignore[arg-type]  # see above
    with pytest.raises(ValueError):
        EngineOptions(max_concurrent_requests=0)


def test_closed_engine_refuses_work() -> None:
    engine = SGLangEngine([SGLangServer(dead_url())])
    engine.close()
    engine.close()
    with pytest.raises(RolloutError, match="closed"):
        engine.generate([], SamplingParams(max_new_tokens=1))


def test_a_refused_connection_says_so_and_is_retried() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nobody listens here once the socket is closed
    options = EngineOptions(request_timeout_s=30, connect_retries=1, retry_backoff_s=0.1)
    engine = SGLangEngine([SGLangServer(f"http://127.0.0.1:{port}")], options)
    with pytest.raises(RolloutError) as info:
        engine.generate([Prompt(0, "", (1, 2))], SamplingParams(max_new_tokens=1))
    assert isinstance(info.value.__cause__, ServerUnreachableError)
    message = str(info.value)
    assert "could not be reached for POST /generate" in message and "refused" in message
    assert "gave up after 2 attempts" in message
    assert "within" not in message  # a refusal is not a timeout


def test_a_server_that_never_answers_times_out_without_retrying() -> None:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # connections complete in the backlog; nobody ever answers
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        options = EngineOptions(request_timeout_s=0.5, connect_retries=3, retry_backoff_s=1.0)
        engine = SGLangEngine([SGLangServer(url)], options)
        started = time.monotonic()
        with pytest.raises(RolloutError, match="did not answer POST /generate within 0.5 s"):
            engine.generate([Prompt(0, "", (1, 2))], SamplingParams(max_new_tokens=1))
        assert time.monotonic() - started < 3  # one timeout, no retry of a call that may still run
