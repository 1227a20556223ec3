"""Where every rank and rollout server of a run goes, decided before anything starts.

:func:`plan_layout` turns what a run asks for (:class:`PlacementRequest`, from slime's flags) and
what the cluster has (:class:`NodeResources` per node) into a :class:`Layout`: a list of *slots*
(one Ray placement-group bundle each) and which slots each role's ranks and each rollout engine
use. It raises :class:`PlacementError`, saying what was asked and what the cluster has, when the
layout cannot fit; :mod:`rlcore.launch.ray.cluster` reserves the slots with Ray. Pure: no Ray here.

The layout, with slime's meaning of the flags (``A`` actor ranks, ``C`` critic ranks, ``R``
rollout GPUs, ``K`` GPUs per engine):

===================  ==================================  =====================================
                     cluster with GPUs (a slot: 1 GPU)    no GPUs (a slot: 1 logical CPU)
===================  ==================================  =====================================
actor                slots ``0 .. A-1``                   slots ``0 .. A-1``
reference model      the actor's slots                    the actor's slots
OPD teacher          the actor's slots                    the actor's slots
critic               its own slots ``A .. A+C-1``         slots ``0 .. C-1`` (shared)
rollout engines      ``R / K`` engines of ``K``           the same, counting CPU slots
                     consecutive slots after the others;
                     with ``--colocate``, on the actor's
===================  ==================================  =====================================

Roles that share a slot take turns in the loop (score, then train; the servers sleep while
training), so they split the slot's resources between their processes instead of each claiming
all of it: that is what lets PPO with a critic and a reference model run on a 2-core machine. On
GPUs the critic gets GPUs of its own, as in slime (its optimizer state would not fit beside the
actor's). Slots are filled node by node (Ray's ``PACK``); a rank count larger than one node
spreads over several. Each rank's torch threads are its node's CPUs divided by the slots on that
node, so a node is never oversubscribed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, Literal, final

import attrs

from rlcore.errors import RLCoreError

__all__ = [
    "Layout",
    "NodeResources",
    "PlacementError",
    "PlacementRequest",
    "SlotRole",
    "describe_nodes",
    "plan_layout",
]

SlotRole = Literal["actor", "critic", "reference", "teacher", "rollout"]
_RESOLUTION: Final = 1e-4
"""Ray's resource granularity: fractions are rounded down to it so shares never exceed a slot."""


class PlacementError(RLCoreError):
    """A run's ranks and servers cannot be placed on the cluster (the message says what was asked
    and what the cluster has), or the reservation did not complete in time."""


@final
@attrs.frozen
class NodeResources:
    """One alive node as Ray reports it."""

    node_id: str
    address: str
    cpus: float
    gpus: float = 0.0

    def slots(self, gpu: bool) -> int:
        """How many slots of the layout's kind fit on this node."""
        if gpu:
            return int(min(self.gpus, self.cpus))
        return int(self.cpus)


@final
@attrs.frozen
class PlacementRequest:
    """What a run needs placed. ``critic_ranks = 0``: no critic; ``rollout_gpus = 0``: no
    servers (the embedded engine, or servers reached by URL). ``driver_engine``: the rollout
    engine runs in the driver while the ranks train (the embedded engine under
    ``--max-staleness``), so it gets a slot of its own that no rank shares."""

    actor_ranks: int
    critic_ranks: int = 0
    reference: bool = False
    teacher: bool = False
    rollout_gpus: int = 0
    gpus_per_engine: int = 1
    colocate: bool = False
    driver_engine: bool = False

    def __attrs_post_init__(self) -> None:
        if self.actor_ranks < 1 or self.critic_ranks < 0 or self.rollout_gpus < 0:
            raise ValueError(f"bad rank counts in {self}")
        if self.gpus_per_engine < 1 or self.rollout_gpus % self.gpus_per_engine:
            raise ValueError(
                f"rollout_gpus={self.rollout_gpus} must be a multiple of "
                f"gpus_per_engine={self.gpus_per_engine}"
            )
        if self.colocate and self.rollout_gpus > self.actor_ranks:
            raise ValueError("colocated rollout needs rollout_gpus <= actor_ranks")

    @property
    def engines(self) -> int:
        return self.rollout_gpus // self.gpus_per_engine


@final
@attrs.frozen
class Layout:
    """Slots and who uses them. ``roles[role][r]`` is the slot of rank ``r``;
    ``engines[e]`` the slots of rollout engine ``e``, in GPU order."""

    gpu: bool
    slot_count: int
    roles: Mapping[SlotRole, tuple[int, ...]]
    engines: tuple[tuple[int, ...], ...]
    request: PlacementRequest
    driver_slot: int | None = None
    """The slot kept for an engine in the driver (``request.driver_engine``): no Ray process
    uses it; it keeps the ranks' threads off its cores."""

    @property
    def bundle(self) -> dict[str, float]:
        """One slot's placement-group bundle."""
        return {"GPU": 1.0, "CPU": 1.0} if self.gpu else {"CPU": 1.0}

    def sharers(self, slot: int) -> int:
        """How many processes of the run live in ``slot`` (ranks of each role, an engine's
        host on the engine's first slot)."""
        count = sum(slot in slots for slots in self.roles.values())
        return count + sum(slots[0] == slot for slots in self.engines)

    def share(self, slot: int) -> dict[str, float]:
        """What one process in ``slot`` asks of it: an equal part of each resource."""
        part = 1.0 / max(self.sharers(slot), 1)
        part = int(part / _RESOLUTION) * _RESOLUTION
        return {name: part for name in self.bundle}

    def describe(self) -> str:
        """The layout in a few lines, for the run log and for errors."""
        unit = "GPU" if self.gpu else "CPU slot"
        lines = [f"{self.slot_count} {unit}s ({self.bundle} each):"]
        for role, slots in self.roles.items():
            lines.append(f"  {role}: {len(slots)} rank(s) on {unit}s {_span(slots)}")
        for index, slots in enumerate(self.engines):
            lines.append(f"  rollout engine {index}: {unit}s {_span(slots)}")
        if self.driver_slot is not None:
            lines.append(f"  rollout engine in the driver: {unit} {self.driver_slot}")
        return "\n".join(lines)


def plan_layout(
    request: PlacementRequest, nodes: Sequence[NodeResources], *, check: bool = True
) -> Layout:
    """The layout of ``request`` on a cluster of ``nodes``; :class:`PlacementError` when it does
    not fit (before anything is reserved or started), unless ``check`` is off (a cluster that may
    grow)."""
    gpu = any(node.gpus > 0 for node in nodes)
    a, c, r = request.actor_ranks, request.critic_ranks, request.rollout_gpus
    roles: dict[SlotRole, tuple[int, ...]] = {"actor": tuple(range(a))}
    if request.reference:
        roles["reference"] = roles["actor"]
    if request.teacher:
        roles["teacher"] = roles["actor"]
    if gpu:
        if c:
            roles["critic"] = tuple(range(a, a + c))
        trained = a + c
    else:
        if c:
            roles["critic"] = tuple(range(c))
        trained = max(a, c)
    first_rollout = 0 if request.colocate else trained
    k = request.gpus_per_engine
    engines = tuple(
        tuple(range(first_rollout + e * k, first_rollout + (e + 1) * k))
        for e in range(request.engines)
    )
    slot_count = trained if request.colocate else trained + r
    driver_slot = None
    if request.driver_engine:
        driver_slot, slot_count = slot_count, slot_count + 1
    layout = Layout(gpu, slot_count, roles, engines, request, driver_slot)
    if check:
        _check_fits(layout, nodes)
    return layout


def _check_fits(layout: Layout, nodes: Sequence[NodeResources]) -> None:
    capacity = [node.slots(layout.gpu) for node in nodes]
    unit = "GPU" if layout.gpu else "CPU"
    problems = []
    if layout.slot_count > sum(capacity):
        problems.append(
            f"it needs {layout.slot_count} {unit} slots and the cluster has room for "
            f"{sum(capacity)}"
        )
    k = layout.request.gpus_per_engine
    if layout.engines and k > max(capacity, default=0):
        problems.append(f"a rollout engine needs {k} {unit}s on one node and no node has that many")
    if problems:
        raise PlacementError(
            "the run does not fit on this Ray cluster: "
            + "; ".join(problems)
            + ".\nAsked for "
            + layout.describe()
            + "\nThe cluster has "
            + describe_nodes(nodes)
            + "\nAsk for fewer ranks (--actor-num-nodes, --actor-num-gpus-per-node, "
            "--critic-num-*, --rollout-num-gpus), use --colocate, or add nodes."
        )


def describe_nodes(nodes: Sequence[NodeResources]) -> str:
    """``2 node(s): 10.0.0.1 (4 GPUs, 16 CPUs), ...``."""
    if not nodes:
        return "no alive nodes"
    parts = [
        f"{n.address} [{n.node_id[:8]}] ({_count(n.gpus)} GPUs, {_count(n.cpus)} CPUs)"
        if n.gpus
        else f"{n.address} [{n.node_id[:8]}] ({_count(n.cpus)} CPUs, no GPUs)"
        for n in nodes
    ]
    return f"{len(nodes)} node(s): " + ", ".join(parts)


def _count(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:g}"


def _span(slots: Sequence[int]) -> str:
    if not slots:
        return "-"
    if list(slots) == list(range(slots[0], slots[0] + len(slots))) and len(slots) > 1:
        return f"{slots[0]}-{slots[-1]}"
    return ", ".join(str(s) for s in slots)
