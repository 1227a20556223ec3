"""The shared-memory files (``/dev/shm``) that a process group leaves when it is killed: which
ones it maps, and removing those that nobody maps once it is gone. Used by
:class:`rlcore.engines.hosts.LocalProcess`, in the caller's process and in a small *reaper*
process that this file is when run as a script (``python -I -S _shm.py PGID INTERVAL_S``).

Files are told apart by device and inode, not by name: POSIX semaphores (``sem_open``, which
Python's ``multiprocessing`` locks use; SGLang's scheduler holds one, made by tqdm's
``multiprocessing.RLock``) are created under a temporary name and then linked to their real one,
``sem.mp-*``, so ``/proc/PID/maps`` names a file that was deleted and only the inode leads to the
linked one.

Why a reaper: a group killed outright (a crash, the OOM killer, a parent that died with
``die_with_parent``) maps nothing by the time anyone asks, so what it mapped must have been
recorded while it ran. The reaper records the group's mappings every ``INTERVAL_S`` (a few
milliseconds reading ``/proc``) and, once no process of the group is left, removes the recorded
files that no process maps. It detaches from its starter (forking twice), in its own session:
it outlives a starter killed outright, and a watchdog or Ray that kill the starter's children
(``rlcore.launch.watchdog``, ``RAY_kill_child_processes_on_worker_exit``) do not find it; it
ends with the group it watches. A line on its stdin asks it to look again at once; its stdout
closes when it ends.

Standard library only: the reaper runs isolated (``-I -S``). Linux only (``/proc``).
"""

from __future__ import annotations

import os
import select
import stat
import sys
import time
from collections.abc import Iterable

SHM_DIR = "/dev/shm"

# (device, inode) of a mapped file -> the name it was mapped under, or None when that name was
# deleted (the file may still be linked under another name).
Mapped = dict[tuple[int, int], str | None]


def pids() -> list[int]:
    """Every process of this machine (its pid namespace)."""
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:  # not Linux
        return []


def group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that have not exited (zombies excluded)."""
    members = []
    for pid in pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat_line = f.read()
        except OSError:
            continue  # exited meanwhile
        # after "pid (comm) ": the command name may hold spaces and parentheses
        state, _, group = stat_line[stat_line.rindex(b")") + 2 :].split()[:3]
        if int(group) == pgid and state != b"Z":
            members.append(pid)
    return members


def mapped(pids: Iterable[int]) -> Mapped:
    """The files under ``/dev/shm`` that the processes ``pids`` map, deleted names included."""
    found: Mapped = {}
    prefix = SHM_DIR + "/"
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset device inode path
            if len(fields) == 6 and fields[5].startswith(prefix):
                major, minor = fields[3].split(":")
                key = (os.makedev(int(major, 16), int(minor, 16)), int(fields[4]))
                path = fields[5]
                if path.endswith(" (deleted)"):
                    found.setdefault(key, None)
                else:
                    found[key] = path
    return found


def remove_unmapped(recorded: Mapped) -> list[str]:
    """Remove the files of ``recorded`` that are still linked in ``/dev/shm`` (under any name)
    and that no process maps now; returns their paths."""
    if not recorded:
        return []
    candidates = {path for path in recorded.values() if path is not None}
    try:
        candidates.update(os.path.join(SHM_DIR, name) for name in os.listdir(SHM_DIR))
    except OSError:
        pass
    in_use = mapped(pids())
    removed = []
    for path in sorted(candidates):
        try:
            info = os.lstat(path)
        except OSError:
            continue  # removed meanwhile
        key = (info.st_dev, info.st_ino)
        if stat.S_ISREG(info.st_mode) and key in recorded and key not in in_use:
            try:
                os.unlink(path)
            except OSError:
                continue  # removed meanwhile
            removed.append(path)
    return removed


def reap(pgid: int, interval_s: float) -> None:
    """Record what group ``pgid`` maps every ``interval_s`` (sooner when a line comes on
    stdin) until none of it is left, then remove what it left."""
    recorded: Mapped = {}
    listening = True
    while True:
        try:
            members = group_members(pgid)
            if not members:
                break
            recorded.update(mapped(members))
        except Exception:
            pass  # a process table read mid-change: the next tick reads it again
        if listening:
            if select.select([0], [], [], interval_s)[0] and not os.read(0, 4096):
                listening = False  # the starter closed it (or died): go on by the clock
        else:
            time.sleep(interval_s)
    remove_unmapped(recorded)


if __name__ == "__main__":
    # Detach, keeping the pipes: the starter reaps this first process at once; its child waits
    # until that is gone (it is then init's, or a subreaper's) and only then forks the reaper,
    # which so was never the starter's descendant, even for a moment a watchdog could catch.
    first = os.getpid()
    if os.fork():
        os._exit(0)
    while os.getppid() == first:
        time.sleep(0.001)
    if os.fork():
        os._exit(0)
    reap(int(sys.argv[1]), float(sys.argv[2]))
