"""Ray for the tests: ``ray_cluster`` (a local instance) and ``simulated_cluster`` (several nodes).

Registered from ``tests/conftest.py`` with ``pytest_plugins = ["tests.conftest_ray"]``.

``ray_cluster`` starts a local Ray instance on first use (tests that never ask for it pay nothing)
with exactly what the CLI would declare on this machine: its CPU count (at least 2), no GPUs, no
dashboard, no worker logs forwarded to the test output. A fixture that declared more CPUs than
the machine has once hid a run that could not start on a real 2-core machine. It stays up for
the rest of the session, unless a module needs a simulated cluster instead.

``simulated_cluster`` builds a multi-node cluster on this machine with
:class:`ray.cluster_utils.Cluster` (one raylet per node, each declaring its own CPUs and GPUs; the
GPUs are declared, not real) for a module, after shutting down the local instance if it runs,
and shuts it all down after the module. Keep node resources tiny: every raylet costs memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Final

import pytest

RAY_TEST_CPUS: Final = max(os.cpu_count() or 1, 2)
"""Logical CPUs of the test instance: the same as ``python -m rlcore_megatron.run`` declares."""

NodeShape = tuple[int, int]
"""(CPUs, GPUs) of one simulated node."""


def _start_local() -> None:
    import ray

    ray.init(
        address="local",  # not a cluster someone else began with `ray start` on this machine
        num_cpus=RAY_TEST_CPUS,
        num_gpus=0,
        include_dashboard=False,
        log_to_driver=False,
    )


@pytest.fixture(scope="session")
def _ray_session() -> Iterator[None]:
    """Shuts down at the end of the session whatever Ray the tests left running."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(_ray_session: None) -> None:
    """A local Ray instance with :data:`RAY_TEST_CPUS` logical CPUs (started if none runs)."""
    import ray  # a missing Ray fails the tests that need it instead of skipping them

    if not ray.is_initialized():
        _start_local()


SimulatedCluster = Callable[[Sequence[NodeShape]], str]


@pytest.fixture(scope="module")
def simulated_cluster(_ray_session: None) -> Iterator[SimulatedCluster]:
    """``simulated_cluster([(cpus, gpus), ...])`` starts a cluster with those nodes (the first is
    the head), connects Ray to it and returns its address; a second call replaces the first
    cluster. Everything is shut down after the module."""
    import ray
    from ray.cluster_utils import Cluster

    clusters: list[Cluster] = []

    def stop() -> None:
        if ray.is_initialized():
            ray.shutdown()
        while clusters:
            clusters.pop().shutdown()  # type: ignore[no-untyped-call]  # unannotated in ray

    def start(nodes: Sequence[NodeShape]) -> str:
        stop()
        (head_cpus, head_gpus), *others = nodes
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": head_cpus,
                "num_gpus": head_gpus,
                "include_dashboard": False,
            },
        )
        clusters.append(cluster)
        for cpus, gpus in others:
            cluster.add_node(num_cpus=cpus, num_gpus=gpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        return str(cluster.address)

    try:
        yield start
    finally:
        stop()
