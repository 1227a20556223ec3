"""Processes that die with the process that started them, even when it is killed with ``kill -9``.

A killed process runs no ``finally`` and no ``atexit``: what it started lives on. Ray stops its
own workers when the driver that started it dies, but not what *they* started (Megatron's
checkpoint writer keeps a ``multiprocessing`` manager, about 300 MB, and its resource tracker),
and a launched SGLang server runs in its own session. A watchdog is a small separate Python
process (standard library only, a few MB) that waits for one process to die and then kills what
it left, and removes the shared-memory files torch made for it (``/dev/shm/torch_<pid>_*``: a CPU
rank's parameters live there for tensor-mode weight sync; torch's own ``torch_shm_manager``, which
would remove them, is one of the processes killed with the rank):

- :func:`watch_group` (in each rank's actor): waits for the rank's process, without polling
  (``pidfd``), then kills the rank's process group, which its children share.
- :func:`watch_tree` (in the CLI's driver): records the driver's descendants every
  ``interval_s`` and, when the driver dies, kills the recorded ones still alive and their
  children, then removes the recorded ones' shared-memory files. A process started less than
  ``interval_s`` before the driver is killed may be missed (it was never recorded, and is no
  longer the driver's descendant once orphaned). :meth:`Watchdog.stop` ends it without killing
  anything (a run that ends normally closes its pieces itself).

Linux only (``/proc``, process groups); elsewhere both return ``None`` and nothing is watched.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Final, final

__all__ = ["Watchdog", "remove_shared_memory", "watch_group", "watch_tree"]

# Run as `python -I -S -c _SCRIPT MODE PID [INTERVAL]`: nothing imported but the standard library.
_SCRIPT: Final = r"""
import os, select, signal, sys, time

def stat(pid):
    # (ppid, start time) from /proc/PID/stat; the command name may hold spaces and parentheses.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None

def table():
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = stat(int(name))
            if info is not None:
                out[int(name)] = info
    return out

def descendants(roots, procs):
    children = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found

def wait_for_death(pid, born, interval):
    # Yields every `interval` seconds until `pid` has exited.
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    while True:
        if fd is not None:
            if select.select([fd], [], [], interval)[0]:
                return
        else:
            time.sleep(interval)
            info = stat(pid)
            if info is None or info[1] != born:
                return
        yield

def remove_shared_memory(pids):
    # torch's file_system strategy names its files torch_<creator pid>_...
    prefixes = tuple(f"torch_{p}_" for p in pids)
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith(prefixes)]
    except OSError:
        names = []
    for name in names:
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass  # removed meanwhile

mode, pid = sys.argv[1], int(sys.argv[2])
interval = float(sys.argv[3])
me = os.getpid()
first = stat(pid)
if first is None:
    sys.exit(0)
born = first[1]

def record(recorded):
    # Add the current descendants; keep those recorded before that still run, even when no
    # longer descendants: the watched process may be dying right now, and its children's
    # children then already belong to init.
    procs = table()
    kept = {p: t for p, t in recorded.items() if p in procs and procs[p][1] == t}
    kept.update((p, procs[p][1]) for p in descendants([pid], procs) if p != me)
    return kept

recorded = {}
if mode == "tree":
    recorded = record(recorded)
for _ in wait_for_death(pid, born, interval):
    if mode == "tree":
        try:
            recorded = record(recorded)
        except Exception:
            pass  # a process table read mid-change: the next tick reads it again

remove_shared_memory([pid])  # before killpg, which ends this process too in group mode
if mode == "group":
    os.killpg(pid, signal.SIGKILL)  # the group outlives its leader; this process is in it too
for _ in range(3):  # again, for children forked while we were killing
    procs = table()
    alive = {p for p, t in recorded.items() if p in procs and procs[p][1] == t}
    targets = (alive | descendants(alive, procs)) - {me}
    if not targets:
        break
    for p in targets:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.2)
remove_shared_memory(recorded)  # the killed ones' (a rank's group watchdog may be among them)
"""


@final
class Watchdog:
    """A running watchdog process."""

    def __init__(self, process: subprocess.Popen[bytes], watched: int) -> None:
        self.process = process
        self.watched = watched

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """End the watchdog without it killing anything. Safe to call twice."""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _supported() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir("/proc")


def _start(args: list[str], *, new_session: bool) -> Watchdog:
    process = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _SCRIPT, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Its own session: a Ctrl-C or a hang-up sent to the terminal's process group must not
        # end the watchdog before the process it watches.
        start_new_session=new_session,
    )
    return Watchdog(process, int(args[1]))


def watch_tree(pid: int | None = None, interval_s: float = 1.0) -> Watchdog | None:
    """Start a watchdog that kills ``pid``'s descendants (default: this process's) when ``pid``
    dies. It lists them every ``interval_s`` (reading ``/proc``: a few milliseconds)."""
    if not _supported():
        return None
    return _start(["tree", str(pid or os.getpid()), str(interval_s)], new_session=True)


def watch_group() -> Watchdog | None:
    """Start a watchdog that kills this process's process group when this process dies. Only
    for a process that leads its own group (a Ray worker does); else returns ``None``."""
    if not _supported() or os.getpgid(0) != os.getpid():
        return None
    # In the group it will kill, so that it dies with it; it blocks on a pidfd, never polls.
    return _start(["group", str(os.getpid()), "1.0"], new_session=False)


def remove_shared_memory(pids: Sequence[int], wait_s: float) -> None:
    """Remove torch's shared-memory files (``/dev/shm/torch_<pid>_*``) of the processes ``pids``
    of this machine, once they have exited (waiting up to ``wait_s`` for them; the files of one
    still running after that are left alone)."""
    if not pids or not os.path.isdir("/dev/shm"):
        return
    deadline = time.monotonic() + wait_s
    gone = []
    for pid in pids:
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _running(pid):
            gone.append(pid)
    prefixes = tuple(f"torch_{pid}_" for pid in gone)
    for name in os.listdir("/dev/shm") if prefixes else ():
        if name.startswith(prefixes):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass  # removed meanwhile


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"  # a zombie holds no memory
