"""Weights on their way from a training stack to a rollout engine.

The contract is in :mod:`rlcore.protocols`: a :class:`~rlcore.protocols.WeightSource` (a stack,
or the rank group behind it) sends its weights to the :class:`~rlcore.protocols.WeightSink` s that
a :class:`~rlcore.protocols.RolloutEngine` opens for one update. This module holds the two small
things both sides share: where a sink may run (:data:`SinkPlacement`) and how one pass over the
weights feeds the sinks of one process (:func:`deliver`).

A sink says where it may run because the weights may live in other processes than the caller's:
the ranks of a Megatron group, on other machines. Shipping a sink to them, instead of the weights
to the caller, is what keeps a 15 GB model out of the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, final

import attrs

if TYPE_CHECKING:
    from rlcore.protocols import NamedTensors, WeightSink

__all__ = [
    "AnyProcess",
    "InProcess",
    "OnHost",
    "SinkPlacement",
    "deliver",
    "on_release",
    "release_sender_resources",
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
