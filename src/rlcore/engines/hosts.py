"""This machine as a :class:`~rlcore.protocols.hosts.ProcessHost`: start a server process, watch it,
read its log, stop it and everything it started, and remove the shared-memory files it leaves.

A cluster's hosts (``rlcore.launch.ray.cluster``) run a :class:`LocalProcessHost` on the node they
reserved and forward calls to it, so a server started on another node is handled the same way.
Standard library only (and rlcore's errors and :mod:`rlcore.engines._shm`).
"""

from __future__ import annotations

import atexit
import collections
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, final

from rlcore.engines import _shm
from rlcore.errors import RolloutError

__all__ = ["LocalProcess", "LocalProcessHost", "free_port"]


_PORTS = range(20000, 22000)
"""Where :func:`free_port` looks: below the kernel's ephemeral ports (32768 and up by default),
above Ray's worker ports (10002-19999 by default) and below SGLang's own picks for its servers'
process groups (22000-29999)."""
_GIVEN: set[int] = set()
_PICK = random.SystemRandom()  # not the seeded module generator: processes pick apart


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a process that binds it later (an SGLang
    server binds its port only after loading its model, a minute on a busy CPU). It is outside
    the kernel's ephemeral range: a port that ``bind(0)`` picked is handed out again meanwhile to
    any socket bound to port 0 or connecting out (gloo's, Ray's, another server's), and the
    server then fails to start (uvicorn exits with code 3) while another process holds its
    port. Not one this process gave out before; the OS's pick when none of 64 tries is free."""
    below = range(_PORTS.start, min(_PORTS.stop, _ephemeral_low()))
    ports = [p for p in below if p not in _GIVEN]
    for port in _PICK.sample(ports, min(64, len(ports))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


@final
class LocalProcess:
    """A process started by :class:`LocalProcessHost`, in a session (process group) of its own, so
    that :meth:`stop` ends it and every child it forked (a server's scheduler, its detokenizer).

    Killed processes cannot unlink their shared memory, and a server's group is killed (SGLang
    kills its own children too, its ``multiprocessing`` resource tracker among them): the
    ``/dev/shm`` files the group mapped and that no process maps once it is gone are removed.
    For an SGLang server: its 16 KB ``sglang_loads_*`` load snapshot, which SGLang never unlinks,
    and its 32-byte ``sem.mp-*`` semaphore (tqdm's ``multiprocessing.RLock`` in the scheduler,
    which only the scheduler's clean exit or the killed resource tracker would unlink). Files
    that others still map (a weight sender's) stay. :meth:`stop` records the mappings before it
    signals the group and removes the files once the group is gone; a reaper process
    (:mod:`rlcore.engines._shm`) records them every second while the group
    runs, so that a group that dies without :meth:`stop` (killed outright, or killed with a
    parent that started it with ``die_with_parent``) leaves nothing either.
    """

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        log_path: Path,
        log_file: IO[bytes],
        reaper: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self._popen = popen
        self.log_path = log_path
        self._log_file: IO[bytes] | None = log_file
        self._reaper = reaper
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
        """SIGTERM to the process group, SIGKILL after ``timeout_s``; then the shared memory it
        left. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        process = self._popen
        files = _shm.mapped(_shm.group_members(process.pid))
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=timeout_s)
        # Children may outlive the parent: end the group anyway.
        _signal_group(process, signal.SIGKILL)
        gone = _wait_group_gone(process.pid, min(timeout_s, 5.0))
        if gone:
            _shm.remove_unmapped(files)
        if self._reaper is not None:
            _finish_reaper(self._reaper, 5.0 if gone else 0.0)
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
        return LocalProcess(popen, log_path, log_file, _start_reaper(popen.pid))


_REAPER_INTERVAL_S = 1.0


def _start_reaper(pgid: int) -> subprocess.Popen[bytes] | None:
    """Start the reaper of group ``pgid`` (see :mod:`rlcore.engines._shm`); ``None`` where it
    cannot run (no ``/proc``)."""
    if not os.path.isdir("/proc") or not os.path.isdir(_shm.SHM_DIR) or not sys.executable:
        return None
    try:
        reaper = subprocess.Popen(
            [sys.executable, "-I", "-S", _shm.__file__, str(pgid), str(_REAPER_INTERVAL_S)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            # Its own session: not in the group it watches (which gets killed), nor in the
            # caller's (a Ctrl-C to the terminal's group must not end it).
            start_new_session=True,
        )
        reaper.wait(timeout=60)  # the first process forks the reaper and exits
    except (OSError, subprocess.TimeoutExpired):
        return None
    return reaper


def _finish_reaper(reaper: subprocess.Popen[bytes], wait_s: float) -> None:
    """Ask the reaper to look at its group now and wait up to ``wait_s`` for it to end (it ends
    once the group is gone, after removing what the group left)."""
    assert reaper.stdin is not None and reaper.stdout is not None
    try:
        reaper.stdin.write(b"\n")
        reaper.stdin.close()
    except OSError:
        pass  # it has ended
    if wait_s > 0:
        # Its stdout closes when it ends.
        select.select([reaper.stdout], [], [], wait_s)
    reaper.stdout.close()


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


def _wait_group_gone(pgid: int, wait_s: float) -> bool:
    """Whether every process of group ``pgid`` has exited, waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while _shm.group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
