"""A small disk that fills: a tmpfs of a given size, mounted for one test.

The tests of a full disk write into it for real (``OSError(ENOSPC)`` comes from the kernel, not
from a mock). Mounting needs the right to mount (root, as in CI); where it is missing the test
is skipped with that reason.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SmallDisk = Callable[[int], Path]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    """``small_disk(n)``: a new empty folder on a tmpfs of ``n`` bytes (rounded up to pages),
    unmounted after the test."""
    mounted: list[Path] = []

    def make(size: int) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
            text=True,
        )
        if done.returncode:
            pytest.skip(
                f"a small disk is a tmpfs mount, which this user cannot make: {done.stderr}"
            )
        mounted.append(folder)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)
