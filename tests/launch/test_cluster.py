"""Placement on simulated clusters (``ray.cluster_utils.Cluster``: several raylets on this machine,
each declaring its CPUs and GPUs): which node and GPU every actor, critic and rollout rank is
given, colocated and disjoint; refusals before anything starts; and a run whose ranks are spread
over two CPU nodes training end to end.

The GPUs are declared, not real: the ranks here run a light stand-in runtime that reports what Ray
gave them (node, GPU ids, ``LOCAL_RANK``, ``MASTER_ADDR``, ``CUDA_VISIBLE_DEVICES``) instead of
Megatron, and the rollout hosts are asked which GPUs a server would get, without starting one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Literal, final

import attrs
import pytest
import ray
from ray.util.placement_group import placement_group_table

from rlcore.launch.placement import PlacementError, PlacementRequest
from rlcore.launch.ray.cluster import ClusterPlacement
from rlcore.launch.ray.ranks import GroupOptions
from rlcore.launch.ray.stacks import RayBackend, RayEvalStack
from rlcore.launch.ray.worker import RankContext
from rlcore.protocols.stacks import Backend, EvalStack, TrainingStack
from rlcore.samples import Sample
from rlcore.specs import EvalSpec, ModelSpec, ParallelSpec, TrainSpec
from rlcore.weights import WeightSink, deliver
from tests.conftest_ray import SimulatedCluster

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@final
@attrs.frozen
class _Stack:
    kind: ClassVar[Literal["eval"]] = "eval"  # ClassVar: not an attrs field
    model_spec: ModelSpec

    @property
    def spec(self) -> ModelSpec:
        return self.model_spec

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return []

    def load(self, path: Path) -> int:
        return 0

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        deliver([], sinks)


@final
@attrs.frozen
class _Backend:
    def build_eval_stack(self, spec: EvalSpec) -> EvalStack:
        return _Stack(spec.model)

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack:
        raise NotImplementedError


@final
@attrs.frozen
class WhereRuntime:
    """No torch.distributed, no Megatron: the rank only exists to say where it is."""

    def init(self, parallel: ParallelSpec, seed: int) -> None:
        pass

    def backend(self) -> Backend:
        return _Backend()


def _where(context: RankContext[EvalStack]) -> dict[str, object]:
    runtime = ray.get_runtime_context()
    return {
        "node": runtime.get_node_id(),
        "gpus": runtime.get_accelerator_ids()["GPU"],
        "LOCAL_RANK": os.environ["LOCAL_RANK"],
        "MASTER_ADDR": os.environ["MASTER_ADDR"],
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"],
    }


def _ranks(backend: RayBackend, role: str, ranks: int) -> RayEvalStack:
    spec = EvalSpec(ModelSpec(role, None, parallel=ParallelSpec(1, ranks)))  # type: ignore[arg-type]
    return backend.build_eval_stack(spec)


def _pg_count() -> int:
    return sum(pg["state"] != "REMOVED" for pg in placement_group_table().values())


@pytest.fixture(scope="module")
def two_gpu_nodes(simulated_cluster: SimulatedCluster) -> list[str]:
    """Two nodes with 2 (declared) GPUs and 2 CPUs each; the node ids, head first."""
    simulated_cluster([(2, 2), (2, 2)])
    return [n["NodeID"] for n in ray.nodes()]  # type: ignore[no-untyped-call]


OPTIONS = GroupOptions(setup_timeout_s=180, call_timeout_s=120)


def test_disjoint_gpus_for_actor_critic_and_rollout(two_gpu_nodes: list[str]) -> None:
    request = PlacementRequest(actor_ranks=2, critic_ranks=1, reference=True, rollout_gpus=1)
    with ClusterPlacement.reserve(request, timeout_s=60) as placement:
        with RayBackend(WhereRuntime(), placement, OPTIONS) as backend:
            actor = _ranks(backend, "actor", 2).group.run_on_all_ranks(_where)
            critic = _ranks(backend, "critic", 1).group.run_on_all_ranks(_where)
            (host,) = placement.start_hosts()
        # The actor's two ranks fill one node, GPU 0 and GPU 1, LOCAL_RANK = the GPU.
        assert actor[0]["node"] == actor[1]["node"]
        assert [r["gpus"] for r in actor] == [["0"], ["1"]]
        assert [r["LOCAL_RANK"] for r in actor] == ["0", "1"]
        # Every GPU process sees all of its node's GPUs (Ray sets no CUDA_VISIBLE_DEVICES).
        assert all(r["CUDA_VISIBLE_DEVICES"] is None for r in actor + critic)
        # The critic and the rollout engine share the other node, one GPU each.
        other = critic[0]["node"]
        assert other != actor[0]["node"]
        critic_gpus = critic[0]["gpus"]
        assert isinstance(critic_gpus, list) and len(host.gpu_ids) == 1
        assert sorted([*critic_gpus, str(host.gpu_ids[0])]) == ["0", "1"]
        # The reference model shares the actor's GPUs: the same bundles, half of each.
        reference = placement.slots("reference")
        assert [s.bundle_index for s in reference] == [
            s.bundle_index for s in placement.slots("actor")
        ]
        assert reference[0].resources == {"GPU": 0.5, "CPU": 0.5}
        # Two slots per node, 2 CPUs per node: one torch thread per rank.
        assert {r["OMP_NUM_THREADS"] for r in actor + critic} == {"1"}
    assert _pg_count() == 0


def test_colocated_rollout_on_the_actor_gpus(two_gpu_nodes: list[str]) -> None:
    request = PlacementRequest(actor_ranks=4, rollout_gpus=4, gpus_per_engine=2, colocate=True)
    with ClusterPlacement.reserve(request, timeout_s=60) as placement:
        assert "rollout engine 1: GPUs 2-3" in placement.describe()
        with RayBackend(WhereRuntime(), placement, OPTIONS) as backend:
            actor = _ranks(backend, "actor", 4).group.run_on_all_ranks(_where)
            hosts = placement.start_hosts()
    # Ranks 0-1 on one node, 2-3 on the other, each on its own GPU; rank 0's node is the master.
    assert actor[0]["node"] == actor[1]["node"] != actor[2]["node"] == actor[3]["node"]
    assert [r["gpus"] for r in actor] == [["0"], ["1"], ["0"], ["1"]]
    assert [r["LOCAL_RANK"] for r in actor] == ["0", "1", "0", "1"]
    assert len({r["MASTER_ADDR"] for r in actor}) == 1
    # Each engine: tensor parallel over the two GPUs of one node, the GPUs its actor ranks use.
    assert [h.gpu_ids for h in hosts] == [(0, 1), (0, 1)]
    assert _pg_count() == 0


def test_more_than_the_cluster_has_is_refused_at_once(two_gpu_nodes: list[str]) -> None:
    before = len(placement_group_table())
    started = time.monotonic()
    with pytest.raises(PlacementError) as caught:
        ClusterPlacement.reserve(PlacementRequest(actor_ranks=6), timeout_s=600)
    assert time.monotonic() - started < 10  # not the 600 s reservation limit
    message = str(caught.value)
    assert "it needs 6 GPU slots and the cluster has room for 4" in message
    assert "actor: 6 rank(s) on GPUs 0-5" in message
    assert "2 node(s):" in message and "(2 GPUs, 2 CPUs)" in message
    with pytest.raises(PlacementError, match="a rollout engine needs 4 GPUs on one node"):
        ClusterPlacement.reserve(PlacementRequest(actor_ranks=1, rollout_gpus=4, gpus_per_engine=4))
    assert len(placement_group_table()) == before  # nothing was reserved


def test_a_cluster_that_may_grow_is_waited_for_and_said_so(
    two_gpu_nodes: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="rlcore"):
        with pytest.raises(PlacementError, match="did not grant 6 slots .* within 8 s"):
            ClusterPlacement.reserve(PlacementRequest(actor_ranks=6), timeout_s=8, may_grow=True)
    assert 8 <= time.monotonic() - started < 60
    waits = [r.getMessage() for r in caplog.records if "waiting for 6 slots" in r.getMessage()]
    assert waits and "the cluster may add nodes" in waits[0]
    assert _pg_count() == 0


def test_ranks_spread_over_two_cpu_nodes_train_end_to_end(
    simulated_cluster: SimulatedCluster, tmp_path: Path
) -> None:
    """Two nodes of one CPU each: the actor's two ranks cannot share a node, so data parallelism
    runs across nodes (gloo between raylets), driven by the CLI's own code path."""
    from rlcore.config.flags import load_config
    from rlcore.launch.cli import execute
    from rlcore.launch.demo import prepare_demo

    simulated_cluster([(1, 0), (1, 0)])
    nodes = [n["NodeID"] for n in ray.nodes()]  # type: ignore[no-untyped-call]
    demo = tmp_path / "demo"
    prepare_demo(demo)
    out = tmp_path / "out"
    # fmt: off
    flags = [
        "--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "train.jsonl"),
        "--input-key", "prompt", "--label-key", "answer", "--num-rollout", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8",
        "--micro-batch-size", "4", "--rollout-max-response-len", "5", "--lr", "1e-3",
        "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--output-dir", str(out),
    ]
    # fmt: on
    result = execute(load_config(flags))
    assert result.trained == (0, 1)
    log = (out / "run.log").read_text()
    slots = [line for line in log.splitlines() if "slot " in line and ": node " in line]
    assert len(slots) == 2
    assert {node[:8] for node in nodes} == {line.split("[")[1][:8] for line in slots}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/actor/loss" in r] == [1, 2]
    assert _pg_count() == 0
