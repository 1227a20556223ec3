"""Weights on their way from a training stack to a rollout engine.

A :class:`WeightSource` (a stack, or the rank group behind it) sends its weights to the
:class:`WeightSink` s that a :class:`~rlcore.protocols.engine.RolloutEngine` opens for one update.
This module holds that contract and the two small things both sides share: where a sink may run
(:data:`SinkPlacement`) and how one pass over the weights feeds the sinks of one process
(:func:`deliver`). It imports nothing else of rlcore (torch only for the type checker), so the
protocols build on it.

A sink says where it may run because the weights may live in other processes than the caller's:
the ranks of a Megatron group, on other machines. Shipping a sink to them, instead of the weights
to the caller, is what keeps a 15 GB model out of the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, final

import attrs

if TYPE_CHECKING:
    import torch

__all__ = [
    "AnyProcess",
    "InProcess",
    "NamedTensors",
    "OnHost",
    "SinkPlacement",
    "WeightSink",
    "WeightSource",
    "deliver",
    "on_release",
    "release_sender_resources",
    "send_exported",
    "takes_of",
    "Takes",
]


@final
@attrs.frozen
class InProcess:
    """The sink must run in the process that opened the update: it writes into an object that
    lives there (the embedded engine's model). A source whose weights live elsewhere brings them
    to that process first."""


@final
@attrs.frozen
class AnyProcess:
    """The sink pickles, and any one process that holds the full weights and can reach the engine
    may run it (a network transfer, a shared folder)."""


@final
@attrs.frozen
class OnHost:
    """The sink pickles, and must run on the machine with IP ``address``: it hands the engine
    shared-memory (or CUDA IPC) handles, which only mean something on that machine."""

    address: str


SinkPlacement = InProcess | AnyProcess | OnHost

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]
"""Weights under Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``)."""


class WeightSink(Protocol):
    """Receives one full set of weights for one update of a rollout engine.

    ``receive`` is called once per update, with every weight under its Hugging Face name, in a
    process that ``placement`` allows: :class:`InProcess` (the one that opened the update),
    :class:`AnyProcess` or :class:`OnHost` (the sink is picklable and may be shipped there). A sink
    may read the iterable once, as it comes, and cut it into buckets. It raises
    :class:`~rlcore.errors.RolloutError` when the engine refuses.
    """

    @property
    def placement(self) -> SinkPlacement: ...

    def receive(self, weights: NamedTensors) -> None: ...


@final
@attrs.frozen
class Takes:
    """What a sink accepts besides each weight in its Hugging Face shape and in the dtype the
    model computes in: a sink says so with a ``takes`` attribute (the embedded engine's takes
    both); :func:`takes_of` reads it. A source that can give less than a copy then does, so that
    the sink's own copy is the only one."""

    row_blocks: bool = False
    """A weight as row blocks: ``[blocks, rows, *rest]`` for its ``[blocks * rows, *rest]``, the
    same elements in the same order: a strided view of a source weight that interleaves several
    weights' rows (Megatron's fused QKV holds q, k and v rows per query group)."""
    any_dtype: bool = False
    """A floating-point weight in another floating dtype, cast by the sink's copy: the fp32
    weights a ``--bf16`` FSDP stack trains, not bf16 copies made for the sink."""


def takes_of(sinks: Sequence[WeightSink]) -> Takes:
    """What every one of ``sinks`` takes (nothing more when there are none)."""
    said = [t for t in (getattr(sink, "takes", None) for sink in sinks) if isinstance(t, Takes)]
    if not sinks or len(said) < len(sinks):
        return Takes()
    return Takes(all(t.row_blocks for t in said), all(t.any_dtype for t in said))


class WeightSource(Protocol):
    """Holds a model's weights and can send them to an engine's sinks from where they live."""

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        """Give every sink the full (unsharded) weights under Hugging Face names, each from a
        process its ``placement`` allows. Raises :class:`~rlcore.errors.RLCoreError` when a sink
        cannot be placed (naming the sink and where the weights are)."""
        ...


def deliver(weights: NamedTensors, sinks: Sequence[WeightSink]) -> None:
    """Feed one pass over ``weights`` to every sink, in this process.

    One sink reads the iterable as it comes (a generator that gathers tensors one by one is never
    held whole); several sinks share one list of the pairs (the tensors themselves are not copied).
    """
    if len(sinks) == 1:
        sinks[0].receive(weights)
        return
    pairs = list(weights)
    for sink in sinks:
        sink.receive(pairs)


_RELEASERS: list[Callable[[], None]] = []


def on_release(release: Callable[[], None]) -> None:
    """Have :func:`release_sender_resources` call ``release`` (once, however often registered): for
    what a sink keeps in the sending process from one update to the next, such as tensor mode's
    shared-memory buffers."""
    if release not in _RELEASERS:
        _RELEASERS.append(release)


def release_sender_resources() -> None:
    """Free what sinks kept in this process between updates. A process whose stack is closed calls
    it (a Megatron rank, before it is killed: shared memory outlives a killed process)."""
    for release in _RELEASERS:
        release()


def send_exported(weights: NamedTensors, sinks: Sequence[WeightSink]) -> None:
    """One rank's part of sending weights whose export is a collective (each tensor gathered
    over the ranks that hold a shard of it): ``sinks`` (those given to this rank, maybe none)
    receive the export, and the export runs to its end even when there are none or one fails,
    since every rank must take part in each gather. Called on every rank."""
    weights = iter(weights)
    try:
        if sinks:
            deliver(weights, sinks)
    finally:
        for _ in weights:
            pass
