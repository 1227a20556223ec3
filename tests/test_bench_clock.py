"""benchmarks/clock.py's CPU clock counts the work of the processes this one starts (a Ray rank
actor's, in benchmarks.rl_step --cpu-time), not only its own, and not the time spent waiting."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks.clock import TreeCPUClock


def test_the_tree_clock_counts_a_child_s_cpu_and_not_sleep() -> None:
    clock = TreeCPUClock()
    start = clock()
    burn = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
    child = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(30)"])
    try:
        while clock() - start < 0.4:  # the child's 0.5 CPU seconds show while it still runs
            assert child.poll() is None
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
    idle = clock()
    time.sleep(0.3)
    assert clock() - idle < 0.1  # sleeping costs no CPU; the dead child's seconds are kept
    assert clock() >= idle
