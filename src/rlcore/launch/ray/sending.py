"""Weights from a Ray rank group to the engines' sinks: :func:`send_weights` (and
:func:`export_weights` for tests and tools), as :class:`~rlcore.launch.ray.stacks.RayEvalStack`
and :class:`~rlcore.launch.ray.stacks.RayTrainingStack` send them.

Every rank takes part in the export (it gathers over tensor parallel, so every rank ends up with the
full tensors), and each engine sink runs on one rank, chosen by where the sink may run: an
:class:`~rlcore.weights.AnyProcess` sink on rank 0, an :class:`~rlcore.weights.OnHost` sink on the
first rank on that machine. Only an :class:`~rlcore.weights.InProcess` sink (the embedded engine,
which lives in the driver) brings the weights to the driver: the first rank on the driver's machine
says which shared-memory files they lie in (:mod:`rlcore.engines.shared_tensors`: a CPU rank's
parameters and export buffers as they are, anything else, CUDA tensors included, copied into one
reusable shared buffer of the rank), the driver maps those files, and the sink's copy into its model
is the one copy on the way; the driver keeps the mappings from one sync to the next (a fresh mapping
would fault every page in again) and drops them when the stack closes. With no rank on the driver's
machine, rank 0 returns copies through Ray's object store.

When every tensor so described is (a view of) the rank's parameters themselves
(:func:`~rlcore.engines.shared_tensors.is_shared_parameter`: a CPU rank's, given as they are to
in-process sinks that take row blocks and any dtype, :class:`~rlcore.weights.Takes`), and no sink
runs on a rank, the next sync does not call the ranks at all: the driver copies from the
views it keeps, which a training step updated in place. That holds until a call that may move
parameters in memory (:attr:`~rlcore.launch.ray.ranks.RankGroup.layout_epoch`: anything but a
forward, a training step or a weight sync), after which the ranks describe them again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final, Literal, TypeAlias, TypeVar, cast, final

import attrs
import ray

from rlcore.launch.ray.ranks import RankGroup, RayGroupError
from rlcore.launch.ray.worker import RankContext
from rlcore.protocols.stacks import ModelStack
from rlcore.weights import (
    AnyProcess,
    InProcess,
    NamedTensors,
    OnHost,
    Takes,
    WeightSink,
    deliver,
    takes_of,
)

if TYPE_CHECKING:
    import torch

    from rlcore.engines.shared_tensors import Mappings, SharedBuffers, SharedTensor

__all__ = ["export_weights", "forget_mappings", "send_weights"]

_LOOPBACK: Final = ("127.0.0.1", "localhost", "::1")
S = TypeVar("S", bound=ModelStack)
Pairs: TypeAlias = "list[tuple[str, torch.Tensor]]"
_Keep = Literal["", "copy", "share"]
"""What a rank returns to the driver besides sending: nothing, copies of the weights (through the
object store) or where they lie in shared memory."""

# The driver's mappings of each group's shared weights, kept from one sync to the next.
_MAPPED: weakref.WeakKeyDictionary[RankGroup[ModelStack], Mappings] = weakref.WeakKeyDictionary()


@final
@attrs.frozen
class _Live:
    """A group's mapped weights that are its relay rank's parameters themselves."""

    pairs: Pairs
    epoch: int
    """The group's :attr:`~rlcore.launch.ray.ranks.RankGroup.layout_epoch` when described."""
    takes: Takes
    """What the sinks they were described for take."""


_LIVE: weakref.WeakKeyDictionary[RankGroup[ModelStack], _Live] = weakref.WeakKeyDictionary()


def send_weights(group: RankGroup[S], sinks: Sequence[WeightSink]) -> None:
    """Every sink gets the full weights from a rank its placement allows (see the module's
    notes); the driver sees them only for :class:`~rlcore.weights.InProcess` sinks."""
    here = [sink for sink in sinks if isinstance(sink.placement, InProcess)]
    per_rank: dict[int, list[WeightSink]] = {rank: [] for rank in range(group.world_size)}
    for sink in sinks:
        placement = sink.placement
        if isinstance(placement, AnyProcess):
            per_rank[0].append(sink)
        elif isinstance(placement, OnHost):
            per_rank[_rank_on(group, placement.address, sink)].append(sink)
    beside = _rank_beside_driver(group) if here else None
    relay = 0 if beside is None else beside
    keep: _Keep = "" if not here else "copy" if beside is None else "share"
    takes = takes_of(here)
    key = cast(RankGroup[ModelStack], group)
    if keep == "share" and not any(per_rank.values()) and key in _LIVE:
        with group.between_calls("send_weights"):  # no step changes them while copied
            live = _LIVE.get(key)
            if live is not None and (live.epoch, live.takes) == (group.layout_epoch, takes):
                deliver(live.pairs, here)
                return
    args = {
        rank: (tuple(chosen), keep if rank == relay else "", takes)
        for rank, chosen in per_rank.items()
    }
    with group.between_calls("send_weights"):  # the epoch the description is valid in
        results = group.call_ranks(_send_weights, args, "send_weights", in_place=True)
        epoch = group.layout_epoch
    if not here:
        return
    if keep == "share":
        from rlcore.engines.shared_tensors import Mappings

        mappings = _MAPPED.get(key)
        if mappings is None:
            mappings = _MAPPED[key] = Mappings()
        described, parameters = cast("tuple[list[SharedTensor], bool]", results[relay])
        pairs = mappings.open(described)
        if parameters:
            _LIVE[key] = _Live(pairs, epoch, takes)
        else:
            _LIVE.pop(key, None)
    else:
        pairs = cast(Pairs, results[relay])
    deliver(pairs, here)


def forget_mappings(group: RankGroup[S]) -> None:
    """Drop the driver's mappings of ``group``'s shared weights (when it closes)."""
    key = cast(RankGroup[ModelStack], group)
    _LIVE.pop(key, None)
    mappings = _MAPPED.pop(key, None)
    if mappings is not None:
        mappings.close()


def export_weights(group: RankGroup[S]) -> list[tuple[str, torch.Tensor]]:
    """The full weights under Hugging Face names, in the driver (copies of rank 0's, through the
    object store; every rank takes part in the gather). For tests and tools: the loop sends
    weights with :func:`send_weights`."""
    args = {rank: ((), "copy" if rank == 0 else "", Takes()) for rank in range(group.world_size)}
    exported = group.call_ranks(_send_weights, args, "export_weights", in_place=True)[0]
    return cast(Pairs, exported)


def _rank_beside_driver(group: RankGroup[S]) -> int | None:
    """The first rank on the driver's machine, if any."""
    here = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated
    return next((r for r, node in enumerate(group.nodes) if node.address == here), None)


def _rank_on(group: RankGroup[S], address: str, sink: WeightSink) -> int:
    """The first rank on the machine ``address`` (loopback: the driver's machine)."""
    if address in _LOOPBACK:
        address = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # unannotated
    for rank, node in enumerate(group.nodes):
        if node.address == address:
            return rank
    where = sorted({node.address for node in group.nodes})
    raise RayGroupError(
        f"{type(sink).__name__} must run on {address}, where no rank of the "
        f"{group.model_spec.role} runs (its ranks are on {where}): shared-memory weight sync "
        "needs a training rank on each server's machine; use --weight-sync distributed, or "
        "place the servers beside the actor (--colocate)"
    )


# Run inside the rank actors (module level, so they pickle by reference).


def _send_weights(
    context: RankContext[ModelStack], sinks: tuple[WeightSink, ...], keep: _Keep, takes: Takes
) -> Pairs | tuple[list[SharedTensor], bool]:
    """Every rank sends (the export is collective); ``sinks`` receive here, and the weights also
    go back to the driver as ``keep`` says, as the driver's sinks ``takes`` them. Shared, they
    come with whether every one is the rank's parameters themselves."""
    collected = _Collect(takes)
    context.stack.send_weights([*sinks, collected] if keep else list(sinks))
    if keep != "share":
        return [(name, t.detach().to("cpu").contiguous()) for name, t in collected.pairs]
    from rlcore.engines.shared_tensors import describe, is_shared_parameter, use_file_system

    use_file_system()
    shared = _handoff_buffer().share(collected.pairs, 0, keep_cuda=False)
    return describe(shared), all(is_shared_parameter(t) for _, t in shared)


_HANDOFF: list[SharedBuffers] = []


def _handoff_buffer() -> SharedBuffers:
    """This rank's shared buffer for weights handed to the driver (made on first use)."""
    if not _HANDOFF:
        from rlcore.engines.shared_tensors import SharedBuffers

        _HANDOFF.append(SharedBuffers(1))
    return _HANDOFF[0]


@final
class _Collect:
    """A sink that keeps the weights it is given (valid until the stack's next export), to
    return them to the driver."""

    def __init__(self, takes: Takes) -> None:
        self.pairs: Pairs = []
        self.takes = takes

    @property
    def placement(self) -> AnyProcess:
        return AnyProcess()

    def receive(self, weights: NamedTensors) -> None:
        self.pairs = [(name, t.detach()) for name, t in weights]
