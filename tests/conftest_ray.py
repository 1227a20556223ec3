"""The ``ray_cluster`` fixture: one small local Ray instance for the whole test session.

Registered from ``tests/conftest.py`` with ``pytest_plugins = ["tests.conftest_ray"]``. Ray is
started on first use only (tests that never ask for it pay nothing) with an explicit resource set:
4 logical CPUs (Ray accepts more than the machine's cores; a rank actor reserves one each), no
GPUs, no dashboard and no worker logs forwarded to the test output. It is shut down at the end
of the session, which stops every Ray process it started.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

import pytest

RAY_TEST_CPUS: Final = 4
"""Logical CPUs of the test cluster: room for a 1-rank and a 2-rank group at once."""


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray instance with :data:`RAY_TEST_CPUS` logical CPUs, shut down after the session."""
    import ray  # a missing Ray fails the tests that need it instead of skipping them

    if ray.is_initialized():  # someone else's cluster: use it, leave it alone
        yield
        return
    ray.init(
        address="local",  # not a cluster someone else began with `ray start` on this machine
        num_cpus=RAY_TEST_CPUS,
        num_gpus=0,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
