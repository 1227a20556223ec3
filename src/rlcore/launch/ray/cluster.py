"""A run's reservation on a Ray cluster: one placement group holding every slot of its
:class:`~rlcore.launch.placement.Layout`, and the places (slots, hosts) handed to rank groups
and rollout engines.

:meth:`ClusterPlacement.reserve`, in order:

1. read the alive nodes' CPUs and GPUs and plan the layout: a layout that cannot fit is refused
   at once, saying what was asked and what the cluster has (unless the cluster may grow: an
   autoscaling cluster is waited for, see 3);
2. ask Ray for one bundle per slot (``PACK``: node by node);
3. wait for the reservation, at most ``timeout_s``, logging every few seconds what the run is
   waiting for (resources held by others, or nodes an autoscaler may add);
4. find where each bundle landed: its node (Ray's placement-group table) and, on GPUs, its GPU
   (a short-lived probe actor per bundle), and order the slots node by node, GPU by GPU, so that
   consecutive ranks share a node (tensor parallel stays inside a node) and a rollout engine's
   GPUs are consecutive ordinals on one node (refused otherwise).

A :class:`RankSlot` is what one rank's actor is started with: its bundle, its share of the slot
(roles that share a slot split it), its torch thread count (its node's CPUs over the run's slots
on that node). A :class:`~rlcore.launch.ray.hosts.RayProcessHost` is a rollout server's place:
a small actor in the engine's first slot that starts the server on that node (and kills it if
the actor dies).

GPU processes see every GPU of their node (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``, as in
slime): a rank selects its GPU by ``LOCAL_RANK`` (the CUDA ordinal Ray assigned it), a server by
``--base-gpu-id``, and CUDA IPC handles between a rank and a server name the same device.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final, final

import attrs
import ray
from ray.exceptions import RayError
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlcore.launch.placement import (
    Layout,
    NodeResources,
    PlacementError,
    PlacementRequest,
    SlotRole,
    describe_nodes,
    plan_layout,
)
from rlcore.launch.ray.hosts import HOST_ACTOR, RayProcessHost

__all__ = [
    "NOSET_CUDA",
    "ClusterPlacement",
    "RankSlot",
    "cluster_nodes",
    "cuda_ordinal",
    "may_autoscale",
]

log = logging.getLogger("rlcore")

NOSET_CUDA: Final = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
_WAIT_LOG_S: Final = 5.0
_CALL_S: Final = 60.0


@final
@attrs.frozen
class RankSlot:
    """Where one process of a rank group goes and what it asks for there."""

    placement_group: PlacementGroup
    bundle_index: int
    resources: Mapping[str, float]
    """Its share of the slot: ``CPU`` and, on GPU clusters, ``GPU``."""
    threads: int
    """torch intra-op threads (``OMP_NUM_THREADS``)."""
    node_id: str
    address: str

    @property
    def gpu(self) -> bool:
        return self.resources.get("GPU", 0.0) > 0

    def scheduling(self) -> dict[str, Any]:
        """Ray ``.options(...)`` that start an actor in this slot."""
        env = {"OMP_NUM_THREADS": str(self.threads)}
        if self.gpu:
            env[NOSET_CUDA] = "1"
        return {
            "num_cpus": self.resources.get("CPU", 0.0),
            "num_gpus": self.resources.get("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self.bundle_index,
            ),
            "runtime_env": {"env_vars": env},
        }


def cluster_nodes() -> list[NodeResources]:
    """The alive nodes of the connected Ray cluster, with their CPU and GPU counts."""
    out = []
    for node in ray.nodes():  # type: ignore[no-untyped-call]  # unannotated in ray
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        out.append(
            NodeResources(
                node_id=str(node["NodeID"]),
                address=str(node["NodeManagerAddress"]),
                cpus=float(resources.get("CPU", 0.0)),
                gpus=float(resources.get("GPU", 0.0)),
            )
        )
    return out


def may_autoscale() -> bool:
    """Whether the connected cluster has an autoscaler configuration (so it may add nodes).

    Read from Ray's autoscaler state (what Ray Data reads too); a cluster started by
    ``ray.init`` or ``ray start`` without an autoscaler has none. When it cannot be read, the
    answer is no: a run that does not fit is refused rather than left waiting.
    """
    try:
        from ray._private.state import state

        return state.get_cluster_config() is not None
    except Exception:  # a private API: any failure means "unknown", treated as "no"
        return False


def cuda_ordinal(gpu_id: str, visible: str | None) -> int:
    """The CUDA device index of Ray's GPU ``gpu_id`` in a process that sees ``visible`` (the
    node's ``CUDA_VISIBLE_DEVICES``, which Ray's ids refer to when it is set)."""
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if gpu_id in ids:
            return ids.index(gpu_id)
    return int(gpu_id)


@final
class _SlotProbe:
    """Says where its bundle is: node, address, and the CUDA ordinal of the bundle's GPU."""

    def where(self) -> tuple[str, str, int | None]:
        context = ray.get_runtime_context()
        gpus = context.get_accelerator_ids().get("GPU", [])
        ordinal = (
            cuda_ordinal(str(gpus[0]), os.environ.get("CUDA_VISIBLE_DEVICES")) if gpus else None
        )
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated
        return context.get_node_id(), ip, ordinal


_PROBE: Final[Any] = ray.remote(_SlotProbe)


@final
@attrs.frozen
class _Slot:
    bundle: int
    node_id: str
    address: str
    gpu: int | None


@final
class ClusterPlacement:
    """The reserved slots of one run (or one rank group started on its own). Close it to give
    them back; it is safe to close twice."""

    def __init__(self, layout: Layout, pg: PlacementGroup, slots: Sequence[_Slot]) -> None:
        self.layout = layout
        self._pg = pg
        self._slots = tuple(slots)
        per_node: dict[str, int] = {}
        for slot in self._slots:
            per_node[slot.node_id] = per_node.get(slot.node_id, 0) + 1
        cpus = {n.node_id: n.cpus for n in cluster_nodes()}
        self._threads = {
            node: max(1, int(cpus.get(node, 1.0) // count)) for node, count in per_node.items()
        }
        self._hosts: list[Any] = []
        self._closed = False

    @classmethod
    def reserve(
        cls,
        request: PlacementRequest,
        *,
        timeout_s: float = 600.0,
        may_grow: bool | None = None,
    ) -> ClusterPlacement:
        """Plan, reserve and map the slots of ``request`` (see the module's notes).

        Raises :class:`~rlcore.launch.placement.PlacementError` at once when the layout does not
        fit a cluster that cannot grow, and after ``timeout_s`` when the reservation is not
        granted; nothing stays reserved after an error.
        """
        if not ray.is_initialized():
            raise PlacementError("Ray is not running: call ray.init(...) first")
        nodes = cluster_nodes()
        grow = may_autoscale() if may_grow is None else may_grow
        try:
            layout = plan_layout(request, nodes)
        except PlacementError:
            if not grow:
                raise
            layout = plan_layout(request, nodes, check=False)
            log.warning("placement: the cluster is too small now; waiting for it to grow")
        pg = placement_group([layout.bundle for _ in range(layout.slot_count)], strategy="PACK")
        try:
            _wait_until_ready(pg, layout, timeout_s, grow)
            slots = _locate(pg, layout, nodes)
            placement = cls(layout, pg, slots)
        except BaseException:
            remove_placement_group(pg)
            raise
        log.info("placement:\n%s", placement.describe())
        return placement

    # -- what goes where -------------------------------------------------------------------------

    def slots(self, role: SlotRole) -> tuple[RankSlot, ...]:
        """One :class:`RankSlot` per rank of ``role``, rank order."""
        try:
            indices = self.layout.roles[role]
        except KeyError:
            raise PlacementError(
                f"the placement has no slots for the {role}: it was reserved for "
                f"{', '.join(self.layout.roles)}"
            ) from None
        return tuple(self._rank_slot(i) for i in indices)

    def _rank_slot(self, index: int) -> RankSlot:
        slot = self._slots[index]
        return RankSlot(
            placement_group=self._pg,
            bundle_index=slot.bundle,
            resources=self.layout.share(index),
            threads=self._threads[slot.node_id],
            node_id=slot.node_id,
            address=slot.address,
        )

    def start_hosts(self) -> tuple[RayProcessHost, ...]:
        """One :class:`RayProcessHost` per rollout engine, started in the engine's first slot
        (its GPUs: the engine's slots' CUDA ordinals)."""
        hosts = []
        for slots in self.layout.engines:
            first = self._rank_slot(slots[0])
            gpu_ids = tuple(self._slots[i].gpu or 0 for i in slots) if first.gpu else ()
            actor = HOST_ACTOR.options(**first.scheduling()).remote(first.address, first.threads)
            self._hosts.append(actor)
            hosts.append(RayProcessHost(actor, first.address, gpu_ids, first.threads))
        for host in hosts:
            host.ping()
        return tuple(hosts)

    def describe(self) -> str:
        """The layout, and the node (and GPU) of every slot."""
        lines = [self.layout.describe()]
        for index, slot in enumerate(self._slots):
            gpu = f" GPU {slot.gpu}" if slot.gpu is not None else ""
            roles: list[str] = [r for r, slots in self.layout.roles.items() if index in slots]
            roles += [f"engine {e}" for e, s in enumerate(self.layout.engines) if index in s]
            if index == self.layout.driver_slot:
                roles.append("the driver's rollout engine")
            lines.append(
                f"  slot {index}: node {slot.address} [{slot.node_id[:8]}]{gpu}, "
                f"{self._threads[slot.node_id]} thread(s): {', '.join(roles) or 'unused'}"
            )
        return "\n".join(lines)

    @property
    def placement_group(self) -> PlacementGroup:
        return self._pg

    @property
    def driver_threads(self) -> int | None:
        """torch threads for a rollout engine in the driver (``request.driver_engine``): its
        slot's share of its node's CPUs; ``None`` without one."""
        if self.layout.driver_slot is None:
            return None
        return self._threads[self._slots[self.layout.driver_slot].node_id]

    def close(self) -> None:
        """Stop the rollout hosts and remove the placement group (the ranks' actors die with
        their groups). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if not ray.is_initialized():
            return
        for actor in self._hosts:
            try:
                ray.get(actor.stop_all.remote(10.0), timeout=30)
            except RayError:
                pass
            ray.kill(actor, no_restart=True)
        remove_placement_group(self._pg)

    def __enter__(self) -> ClusterPlacement:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_until_ready(pg: PlacementGroup, layout: Layout, timeout_s: float, grow: bool) -> None:
    deadline = time.monotonic() + timeout_s
    ready = pg.ready()
    while True:
        left = deadline - time.monotonic()
        done, _ = ray.wait([ready], timeout=max(0.0, min(_WAIT_LOG_S, left)))
        if done:
            ray.get(done[0])
            return
        free = ray.available_resources()  # type: ignore[no-untyped-call]  # unannotated in ray
        why = "the cluster may add nodes" if grow else "other work holds the resources"
        if time.monotonic() >= deadline:
            raise PlacementError(
                f"the cluster did not grant {layout.slot_count} slots of {layout.bundle} within "
                f"{timeout_s:.0f} s ({why}).\nAsked for {layout.describe()}\nThe cluster has "
                f"{describe_nodes(cluster_nodes())}; free now: {_free(free)}"
            )
        log.info(
            "placement: waiting for %d slots of %s (%s); free now: %s; %.0f s left",
            layout.slot_count,
            layout.bundle,
            why,
            _free(free),
            left,
        )


def _free(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{resources.get(k, 0.0):g} {k}" for k in ("CPU", "GPU"))


def _locate(pg: PlacementGroup, layout: Layout, nodes: Sequence[NodeResources]) -> list[_Slot]:
    """Where each bundle landed, as slots ordered node by node (then GPU by GPU)."""
    table = placement_group_table(pg)
    node_of: dict[int, str] = {int(k): str(v) for k, v in table["bundles_to_node_id"].items()}
    address = {n.node_id: n.address for n in nodes}
    bundles = range(layout.slot_count)
    gpus: dict[int, int | None] = dict.fromkeys(bundles)
    if layout.gpu:
        probes = [
            _PROBE.options(
                num_cpus=0,
                num_gpus=0.01,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, b),
                runtime_env={"env_vars": {NOSET_CUDA: "1"}},
            ).remote()
            for b in bundles
        ]
        try:
            answers = ray.get([p.where.remote() for p in probes], timeout=_CALL_S * 5)
        finally:
            for probe in probes:
                ray.kill(probe, no_restart=True)
        for b, (node_id, ip, ordinal) in zip(bundles, answers, strict=True):
            node_of[b], gpus[b] = node_id, ordinal
            address.setdefault(node_id, ip)
    first_seen: dict[str, int] = {}
    for b in bundles:
        first_seen.setdefault(node_of[b], len(first_seen))
    order = sorted(bundles, key=lambda b: (first_seen[node_of[b]], gpus[b] or 0, b))
    slots = [_Slot(b, node_of[b], address.get(node_of[b], "?"), gpus[b]) for b in order]
    for e, engine in enumerate(layout.engines):
        chosen = [slots[i] for i in engine]
        ordinals = [s.gpu for s in chosen]
        same_node = len({s.node_id for s in chosen}) == 1
        if not same_node or (
            layout.gpu
            and ordinals != list(range(ordinals[0] or 0, (ordinals[0] or 0) + len(engine)))
        ):
            raise PlacementError(
                f"rollout engine {e} got slots on {[s.address for s in chosen]} with GPUs "
                f"{ordinals}: an engine's GPUs must be consecutive on one node; make "
                "--rollout-num-gpus-per-engine divide the GPUs of a node (and the ranks before "
                "the rollout GPUs fill whole nodes)"
            )
    return slots
