"""This machine as a :class:`~rlcore.protocols.ProcessHost`: start a server process, watch it,
read its log, stop it and everything it started, and remove the shared-memory files it leaves.

A cluster's hosts (``rlcore_megatron.cluster``) run a :class:`LocalProcessHost` on the node they
reserved and forward calls to it, so a server started on another node is handled the same way.
Standard library only (and rlcore's errors).
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, final

from rlcore.errors import RolloutError

__all__ = ["LocalProcess", "LocalProcessHost", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@final
class LocalProcess:
    """A process started by :class:`LocalProcessHost`, in a session (process group) of its own, so
    that :meth:`stop` ends it and every child it forked (a server's scheduler, its detokenizer).

    Killed processes cannot unlink their shared memory, and a server's group is killed (SGLang
    kills its own children too): :meth:`stop` removes the ``/dev/shm`` files the group had mapped
    when asked to stop and that no process maps once it is gone (SGLang leaves a 16 KB
    ``sglang_loads_*`` file per server otherwise). Files that others still map (a weight
    sender's) stay. Not covered: a 32-byte ``sem.mp-*`` semaphore per SGLang server, which no
    process maps by the time the server is stopped.
    """

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path, log_file: IO[bytes]) -> None:
        self._popen = popen
        self.log_path = log_path
        self._log_file: IO[bytes] | None = log_file
        self._stopped = False
        # It runs in its own session, so it would outlive a caller that dies without stopping it:
        # stop it at interpreter exit too (a no-op once stopped).
        atexit.register(self.stop, 10.0)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def poll(self) -> int | None:
        return self._popen.poll()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``timeout_s``. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        process = self._popen
        files = _shared_memory_mapped(_group_members(process.pid))
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=timeout_s)
        # Children may outlive the parent: end the group anyway.
        _signal_group(process, signal.SIGKILL)
        if files and _wait_group_gone(process.pid, min(timeout_s, 5.0)):
            _remove_unmapped(files)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self, lines: int) -> list[str]:
        if not self.log_path.exists():
            return []
        if self._log_file is not None:
            self._log_file.flush()
        with self.log_path.open("rb") as f:
            tail = collections.deque(f, maxlen=lines)
        return [line.decode("utf-8", "replace").rstrip("\n") for line in tail]


@final
class LocalProcessHost:
    """This machine: servers listen on ``address`` (loopback unless told otherwise)."""

    def __init__(
        self,
        address: str = "127.0.0.1",
        gpu_ids: Sequence[int] = (),
        cpus: int | None = None,
        *,
        die_with_parent: bool = False,
    ) -> None:
        """``die_with_parent``: the process gets SIGKILL when the thread that started it ends
        (Linux), so that a host process killed outright takes its server with it. Only for a
        caller that starts processes from a thread that lives as long as it does."""
        self._address = address
        self._gpu_ids = tuple(gpu_ids)
        self._cpus = cpus if cpus is not None else (os.cpu_count() or 1)
        self._die_with_parent = die_with_parent and sys.platform == "linux"

    @property
    def address(self) -> str:
        return self._address

    @property
    def gpu_ids(self) -> tuple[int, ...]:
        return self._gpu_ids

    @property
    def cpus(self) -> int:
        return self._cpus

    def free_port(self) -> int:
        return free_port(self._address)

    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> LocalProcess:
        """Start ``argv`` with this process's environment updated with ``env``."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = log_path.open("wb")
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
                preexec_fn=_kill_me_with_my_parent if self._die_with_parent else None,
            )
        except OSError as exc:
            log_file.close()
            raise RolloutError(f"could not start {argv[0]!r}: {exc}") from exc
        return LocalProcess(popen, log_path, log_file)


def _kill_me_with_my_parent() -> None:
    """In the child, before exec: ask Linux for SIGKILL when the parent thread exits."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_SHM_DIR = "/dev/shm/"


def _pids() -> list[int]:
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:  # not Linux
        return []


def _group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that have not exited (zombies excluded)."""
    members = []
    for pid in _pids():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        state, _, group = stat[stat.rindex(")") + 2 :].split()[:3]  # after "pid (comm) "
        if int(group) == pgid and state != "Z":
            members.append(pid)
    return members


def _shared_memory_mapped(pids: Iterable[int]) -> set[str]:
    """The ``/dev/shm`` files (still linked) that the processes ``pids`` map."""
    found: set[str] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset device inode path
            if len(fields) == 6 and fields[5].startswith(_SHM_DIR):
                if not fields[5].endswith(" (deleted)"):
                    found.add(fields[5])
    return found


def _wait_group_gone(pgid: int, wait_s: float) -> bool:
    """Whether every process of group ``pgid`` has exited, waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while _group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _remove_unmapped(files: set[str]) -> None:
    """Remove those of ``files`` that no process maps."""
    for path in files - _shared_memory_mapped(_pids()):
        try:
            os.unlink(path)
        except OSError:
            pass  # removed meanwhile
