"""This machine as a :class:`~rlcore.protocols.ProcessHost`: start a server process, watch it,
read its log, stop it and everything it started.

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
from collections.abc import Mapping, Sequence
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
    that :meth:`stop` ends it and every child it forked (a server's scheduler, its detokenizer)."""

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
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait(timeout=timeout_s)
        # Children may outlive the parent: end the group anyway.
        _signal_group(process, signal.SIGKILL)
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
