"""Fixtures for the SGLang tests: a tiny Llama built locally and real SGLang servers on the CPU.

Servers start once per session, all at the same time (their start-up is mostly Python imports):
two data-parallel servers behind ``SGLangEngine.launch`` and one more that a test kills. Tests of
other weight-sync modes connect to the same servers by URL.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest
import torch
from transformers import LlamaForCausalLM

from rlcore.engines.hosts import LocalProcessHost
from rlcore.testing.tiny import build_char_tokenizer, build_tiny_llama
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.launcher import LaunchSettings, start_server
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import SGLangServer

ALPHABET = "0123456789+= abcdefghijklmnopqrstuvwxyz"
STARTUP_TIMEOUT_S = float(os.environ.get("RLCORE_SGLANG_STARTUP_TIMEOUT", "900"))

Weights = dict[str, torch.Tensor]


def _peaked_llama(folder: Path, vocab_size: int, seed: int) -> Weights:
    """A tiny Llama whose output layer is scaled up, so that greedy decoding has clear winners
    (a freshly initialised model is nearly uniform and its argmax would hinge on rounding)."""
    build_tiny_llama(folder, vocab_size=vocab_size, seed=seed)
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(str(folder), safe_serialization=True)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _mapping_lines(servers: Sequence[SGLangServer]) -> Iterator[str]:
    """The lines of ``/proc/PID/maps`` of the servers' processes (schedulers included)."""
    for server in servers:
        assert server.process is not None
        root = psutil.Process(server.process.pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                maps = Path(f"/proc/{process.pid}/maps").read_text()
            except OSError:
                continue  # a helper process that exited meanwhile
            yield from maps.splitlines()


def mapped_files(servers: Sequence[SGLangServer], prefix: str) -> set[str]:
    """The files under ``prefix`` that the servers' processes (schedulers included) map."""
    return {line.split()[-1] for line in _mapping_lines(servers) if prefix in line}


def shared_memory_files(servers: Sequence[SGLangServer]) -> set[str]:
    """The files in /dev/shm that the servers' processes map, found by inode: a POSIX semaphore
    (``sem.mp-*``) is mapped under the temporary name ``sem_open`` made it with, since deleted.
    Recorded while they run, so that these are theirs and not another process's of the moment."""
    inodes: set[int] = set()
    for line in _mapping_lines(servers):
        fields = line.split(maxsplit=5)  # address perms offset device inode path
        if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
            inodes.add(int(fields[4]))
    found = set()
    for path in Path("/dev/shm").iterdir():
        try:
            if path.stat().st_ino in inodes:
                found.add(str(path))
        except OSError:
            continue  # another process's file, removed meanwhile
    return found


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """The transformers references here are tiny: one thread, no contention with the servers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def vocab_size() -> int:
    return 3 + len(ALPHABET)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, vocab_size: int) -> Path:
    """The model the servers start with (its weights are :func:`weights_a`)."""
    folder = tmp_path_factory.mktemp("tiny-llama-a")
    tokenizer = build_char_tokenizer(folder, ALPHABET)
    assert len(tokenizer) == vocab_size
    _peaked_llama(folder, vocab_size, seed=0)
    return folder


@pytest.fixture(scope="session")
def weights_a(tiny_model: Path) -> Weights:
    model = LlamaForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory: pytest.TempPathFactory, vocab_size: int) -> Path:
    """Same architecture, other weights (seed 1): :func:`weights_b`."""
    folder = tmp_path_factory.mktemp("tiny-llama-b")
    build_char_tokenizer(folder, ALPHABET)
    _peaked_llama(folder, vocab_size, seed=1)
    return folder


@pytest.fixture(scope="session")
def weights_b(tiny_model_b: Path) -> Weights:
    model = LlamaForCausalLM.from_pretrained(str(tiny_model_b), dtype=torch.float32)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="session")
def launch_settings(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> LaunchSettings:
    return LaunchSettings(
        model_path=tiny_model,
        device="cpu",
        dtype="float32",
        max_total_tokens=8192,
        startup_timeout_s=STARTUP_TIMEOUT_S,
        log_dir=tmp_path_factory.mktemp("sglang-logs"),
        # Three servers and pytest share a small CI machine; a tiny model gains nothing from more
        # threads, and spinning OpenMP threads on busy cores slow every decode step.
        env={"OMP_NUM_THREADS": "1"},
    )


@pytest.fixture(scope="session")
def _servers(launch_settings: LaunchSettings) -> Iterator[tuple[SGLangEngine, SGLangServer]]:
    victim = start_server(launch_settings, LocalProcessHost(), index=2)  # starts with the others
    try:
        engine = SGLangEngine.launch(
            launch_settings,
            num_servers=2,
            options=EngineOptions(max_prompts_per_request=2, max_concurrent_requests=4),
        )
        try:
            victim.wait_until_healthy(launch_settings.startup_timeout_s)
            yield engine, victim
        finally:
            engine.close()
    finally:
        victim.shutdown()


@pytest.fixture(scope="session")
def dp_engine(_servers: tuple[SGLangEngine, SGLangServer]) -> SGLangEngine:
    """Two launched servers (data parallel), tensor weight sync, two prompts per request."""
    return _servers[0]


@pytest.fixture(scope="session")
def dp_urls(dp_engine: SGLangEngine) -> list[str]:
    return [server.url for server in dp_engine.servers]


@pytest.fixture(scope="session")
def victim_server(_servers: tuple[SGLangEngine, SGLangServer]) -> SGLangServer:
    """A launched server of its own, for the test that kills it."""
    return _servers[1]
