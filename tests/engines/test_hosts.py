"""This machine as a process host: start, watch, read the log of, and stop a server process and
everything it started; with ``die_with_parent``, the process dies with whoever started it."""

from __future__ import annotations

import mmap
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlcore.engines import hosts
from rlcore.engines.hosts import LocalProcess, LocalProcessHost
from rlcore.errors import RolloutError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "\nState:\tZ" not in status.read_text()


def _wait_gone(pid: int, seconds: float = 20.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_start_watch_log_and_stop_a_process_group(tmp_path: Path) -> None:
    host = LocalProcessHost(cpus=3)
    assert (host.address, host.gpu_ids, host.cpus) == ("127.0.0.1", (), 3)
    script = "import os, subprocess, sys, time\n" + textwrap.dedent(
        """
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("hello", os.environ["GREETING"], child.pid, flush=True)
        time.sleep(600)
        """
    )
    process = host.start([sys.executable, "-c", script], {"GREETING": "there"}, tmp_path / "l.log")
    deadline = time.monotonic() + 60
    while not process.log_tail(5) and time.monotonic() < deadline:
        time.sleep(0.1)
    (line,) = process.log_tail(5)
    word, greeting, child = line.split()
    assert (word, greeting) == ("hello", "there")
    assert process.poll() is None
    process.stop(5.0)
    assert process.poll() is not None
    assert _wait_gone(int(child))  # the whole group, not only the process it started
    process.stop(5.0)  # twice is fine


def test_a_program_that_cannot_start_is_a_rollout_error(tmp_path: Path) -> None:
    with pytest.raises(RolloutError, match="could not start '/no/such/program'"):
        LocalProcessHost().start(["/no/such/program"], {}, tmp_path / "l.log")


# A process that maps shared memory as an SGLang server does, and prints "<role> ready" when it
# has: a file of its own, one the test maps too, a POSIX semaphore (made by sem_open under a
# temporary name and then linked to sem.rlcore-test-*, as the multiprocessing locks of SGLang's
# scheduler are), and, as role "parent", a child that maps a file too ("child ready").
# Arguments: the name prefix, the role ("parent" or "alone"), this script.
GROUP_SCRIPT = textwrap.dedent(
    """
    import _multiprocessing, mmap, os, subprocess, sys, time

    def mapped(path):
        fd = os.open(path, os.O_CREAT | os.O_RDWR)
        os.ftruncate(fd, 4096)
        view = mmap.mmap(fd, 4096)
        os.close(fd)
        return view

    prefix, role = sys.argv[1], sys.argv[2]
    if role == "child":
        kept = [mapped(prefix + "-child")]
    else:
        kept = [mapped(prefix + "-own"), mapped(prefix + "-shared")]
        name = "/" + os.path.basename(prefix) + "-semaphore"
        kept.append(_multiprocessing.SemLock(1, 1, 1, name, False))  # kind, value, max, unlink
        if role == "parent":
            subprocess.Popen([sys.executable, "-c", sys.argv[3], prefix, "child"])
    print(role, "ready", flush=True)
    time.sleep(600)
    """
)
SEMAPHORE = "sem.rlcore-test-{pid}-semaphore"


PARENT = """
import sys, time
from pathlib import Path
from rlcore.engines import hosts

hosts._REAPER_INTERVAL_S = 0.1
host = hosts.LocalProcessHost(die_with_parent=True)
script, prefix, log = sys.argv[1:]
process = host.start([sys.executable, "-c", script, prefix, "alone", script], {}, Path(log))
while process.log_tail(1) != ["alone ready"]:
    time.sleep(0.1)
time.sleep(1.0)  # several reaper ticks
print(process.pid, flush=True)
time.sleep(600)
"""


def test_a_process_started_to_die_with_its_parent_does(tmp_path: Path) -> None:
    """What a cluster's rollout host relies on: when the host actor is killed outright, the
    server it started goes too (it runs in its own session, so nothing else would stop it), and
    so does the shared memory it mapped (its reaper outlives the host). Linux's parent-death
    signal, which is what CI runs on."""
    prefix = f"/dev/shm/rlcore-test-{os.getpid()}"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, GROUP_SCRIPT, prefix, str(tmp_path / "l.log")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert parent.stdout is not None
    try:
        with parent.stdout:
            pid = int(parent.stdout.readline())
            assert _alive(pid)
            assert {p.name for p in _ours()} == {
                f"rlcore-test-{os.getpid()}-own",
                f"rlcore-test-{os.getpid()}-shared",
                SEMAPHORE.format(pid=os.getpid()),
            }
            parent.kill()
            parent.wait(timeout=30)
        assert _wait_gone(pid)
        deadline = time.monotonic() + 20
        while _ours() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ours() == []
    finally:
        for path in _ours():
            path.unlink()


def _start_group(host: LocalProcessHost, prefix: str, log: Path) -> LocalProcess:
    process = host.start(
        [sys.executable, "-c", GROUP_SCRIPT, prefix, "parent", GROUP_SCRIPT], {}, log
    )
    deadline = time.monotonic() + 60
    while len(process.log_tail(5)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sorted(process.log_tail(5)) == ["child ready", "parent ready"]
    return process


def test_stop_removes_the_shared_memory_only_the_group_mapped(tmp_path: Path) -> None:
    """What a killed SGLang server leaves in /dev/shm (files its processes mapped, semaphores
    mapped under a name since deleted) is removed when it is stopped; a file that another
    process still maps, or that the group never mapped, stays."""
    prefix = f"/dev/shm/rlcore-test-{os.getpid()}"
    shared = _mapped_here(prefix + "-shared")
    Path(prefix + "-unrelated").write_bytes(b"x")
    try:
        process = _start_group(LocalProcessHost(), prefix, tmp_path / "l.log")
        assert {p.name for p in _ours()} >= {SEMAPHORE.format(pid=os.getpid())}
        process.stop(5.0)
        assert {p.name for p in _ours()} == {
            f"rlcore-test-{os.getpid()}-shared",
            f"rlcore-test-{os.getpid()}-unrelated",
        }
    finally:
        shared.close()
        for path in _ours():
            path.unlink()


def test_a_group_killed_outright_leaves_no_shared_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server killed by someone else (a crash, the OOM killer) maps nothing by the time it is
    stopped: the reaper recorded its files while it ran and removes them once it is gone."""
    monkeypatch.setattr(hosts, "_REAPER_INTERVAL_S", 0.1)
    prefix = f"/dev/shm/rlcore-test-{os.getpid()}"
    shared = _mapped_here(prefix + "-shared")
    try:
        process = _start_group(LocalProcessHost(), prefix, tmp_path / "l.log")
        time.sleep(1.0)  # several reaper ticks
        os.killpg(process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while len(_ours()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)  # no stop yet: the reaper does it alone
        assert [p.name for p in _ours()] == [f"rlcore-test-{os.getpid()}-shared"]
        process.stop(5.0)
    finally:
        shared.close()
        for path in _ours():
            path.unlink()


def _mapped_here(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_CREAT | os.O_RDWR)
    os.ftruncate(fd, 4096)
    view = mmap.mmap(fd, 4096)
    os.close(fd)
    return view


def _ours() -> list[Path]:
    """This test process's files in /dev/shm (semaphores are named ``sem.<name>``)."""
    return sorted(Path("/dev/shm").glob(f"*rlcore-test-{os.getpid()}-*"))


def test_free_ports_are_below_the_ephemeral_range_free_and_never_given_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server binds its port a minute after it was picked: a port out of the kernel's ephemeral
    range cannot be handed meanwhile to a socket bound to port 0 or connecting out."""
    low = hosts._ephemeral_low()
    ports = [hosts.free_port() for _ in range(40)]
    assert len(set(ports)) == len(ports)
    assert all(port < min(low, 22000) for port in ports)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        monkeypatch.setattr(hosts, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(hosts, "_GIVEN", set())
        monkeypatch.setattr(hosts, "_PORTS", range(busy, busy + 1))
        fallback = hosts.free_port()  # the only candidate is in use: the OS picks
        assert fallback != busy
        free = next(p for p in range(busy + 1, busy + 50) if _bindable(p))
        monkeypatch.setattr(hosts, "_PORTS", range(busy, free + 1))
        assert hosts.free_port() == free
        assert hosts.free_port() != free  # given once


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
