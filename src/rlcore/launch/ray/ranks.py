"""One Ray actor per rank of one model, started in reserved slots: :class:`RankGroup`.

The generic part of running a model on Ray ranks: start-up, fanning calls out, diagnosing failures.
What the calls do (score, train, save, send weights) is in :mod:`rlcore.launch.ray.stacks` and
:mod:`rlcore.launch.ray.sending`; where the ranks go is :mod:`rlcore.launch.ray.cluster`'s.

A group is ``ParallelSpec.world_size`` actors (:class:`~rlcore.launch.ray.worker.RankWorker`). Each
actor is one ``torch.distributed`` rank (the backend's rank runtime picks gloo on the CPU, nccl on
GPUs) and holds its shard of one stack (and of the views of its model, below), built inside the
actor by the backend that runtime gives (:class:`~rlcore.backends.RankRuntime`, from the backend's
kind). The driver never holds model weights; it fans a call out to every rank and gathers the
results.

How a group comes up, in order:

1. its slots: given (:meth:`~rlcore.launch.ray.cluster.ClusterPlacement.slots` of a run's
   placement), or reserved for the group alone (one slot per rank, refused at once when the
   cluster cannot hold them);
2. one actor per slot, asking for its share of the slot; rank ``r`` goes in slot ``r``;
3. each rank reports where Ray put it; rank 0 picks a free TCP port on its node; every rank gets
   ``MASTER_ADDR`` (rank 0's node IP), ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
   in its environment and calls the runtime's ``init`` concurrently, so the rendezvous can
   complete;
4. every rank builds its stack from the spec.

``LOCAL_RANK`` is the CUDA ordinal of the GPU Ray assigned to the rank (every GPU process sees all
of its node's GPUs, see :mod:`rlcore.launch.ray.cluster`), or on the CPU the rank's index among the
group's ranks on its node. Threads: ``OMP_NUM_THREADS`` is set from the slot before the process
starts (so Ray leaves it alone) and ``torch.set_num_threads`` once the rank is initialised.

Layout: tensor parallel is fastest (Megatron's default rank order, and TorchTitan's), so rank
``r`` is tensor-parallel rank ``r % tp`` of data-parallel rank ``r // tp``.

Views: an eval stack that a backend builds as a view of a training stack's model
(:attr:`rlcore.backends.BackendKind.model_owner`: with LoRA, the reference is the actor's base
with the adapters disabled) is built in that stack's group, by :meth:`RankGroup.start_view`: a
second group over the same actors, each actor holding both stacks and each call naming its stack's
role. The view's :meth:`~RankGroup.close` only asks the ranks to drop its stack; the actors are
the owner's, whose close kills them (a view then refuses calls). A broken owner breaks its views
and a broken view its owner: they are the same processes.

Lifetime: each rank's actor starts a watchdog (:func:`~rlcore.launch.watchdog.watch_group`)
that kills the processes the rank started when the rank dies, however it dies.
:meth:`RankGroup.close` first asks every rank to free its stack, then kills the actors and
removes what the ranks on the driver's machine left in ``/dev/shm`` (a CPU rank's parameters are
in shared memory, whose files outlive a killed process).

Failures: a call fails as soon as one rank fails. Errors a stack raises on purpose (an
:class:`~rlcore.errors.RLCoreError`) reach the caller as themselves; anything else becomes a
:class:`RayGroupError` naming the rank. When a rank's actor died, a call timed out, or other
ranks were still busy (stuck in a collective) after a failure, the group is *broken*: later calls
raise at once, and the only way on is :meth:`RankGroup.close` and a new group. A dead or silent
rank is a :class:`RankLostError` (what ``--max-restarts`` restarts on). A timeout's error
carries the late ranks' Python stacks, read through the actors' second concurrency group.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Concatenate, Final, Generic, ParamSpec, TypeVar, final

import attrs
import ray
from ray.exceptions import OutOfMemoryError, RayActorError, RayError, RayTaskError

from rlcore.backends import RankRuntime
from rlcore.errors import RLCoreError
from rlcore.launch.placement import PlacementRequest
from rlcore.launch.ray.cluster import ClusterPlacement, RankSlot
from rlcore.launch.ray.failures import RankLostError, RayGroupError, death
from rlcore.launch.ray.worker import ACTOR_CLASS, RankContext
from rlcore.launch.watchdog import remove_shared_memory
from rlcore.protocols.stacks import EvalStack, ModelStack, TrainingStack
from rlcore.specs import EvalSpec, ModelSpec, Role, TrainSpec

__all__ = [
    "GroupOptions",
    "RankGroup",
    "RankLostError",
    "RayGroupError",
]

S = TypeVar("S", bound=ModelStack)
S_co = TypeVar("S_co", bound=ModelStack, covariant=True)
R = TypeVar("R")
_Call = tuple[Callable[..., Any], tuple[object, ...], dict[str, Any]]
P = ParamSpec("P")


_GRACE_S: Final = 10.0
"""After one rank fails, how long the others get to finish before the group counts as broken."""
_RELEASE_TIMEOUT_S: Final = 10.0
"""How long :meth:`RankGroup.close` waits for the ranks to free their stacks before killing."""


@final
@attrs.frozen
class GroupOptions:
    """How long a group waits."""

    setup_timeout_s: float = 600.0
    """Limit for reserving slots (a group started on its own), starting the actors and building
    the stacks."""
    call_timeout_s: float | None = None
    """Limit for one fanned-out call (``None``: none; a failed rank still fails a call at once)."""


@final
@attrs.define
class _Actors:
    """What a group and its views (:meth:`RankGroup.start_view`) share of their actors."""

    broken: str = ""
    """Why the actors cannot take calls any more (see the module's notes), or ``""``."""
    gone: bool = False
    """The owning group closed: the actors are killed."""
    layout_epoch: int = 0
    """Counts the calls to the actors that may have moved a stack's parameters in memory."""
    calls: threading.RLock = attrs.field(factory=threading.RLock)
    """Held while a call runs on the actors (:meth:`RankGroup.between_calls`)."""


@final
@attrs.frozen
class RankNode:
    """Where Ray put one rank: node, its IP, the CUDA ordinal of its GPU (``None``: CPU), and
    the rank's process id there."""

    node_id: str
    address: str
    gpu: int | None
    pid: int


@final
class RankGroup(Generic[S]):
    """``spec.model.parallel.world_size`` ranks as Ray actors; calls fanned out to them.

    Build one with :meth:`start_training` or :meth:`start_eval` (Ray must be initialised). Every
    call waits until all ranks it went to are done or one fails (see the module's notes on
    failures). :meth:`close` kills the actors (and gives back slots the group reserved itself);
    it is safe to call twice.
    """

    def __init__(
        self,
        spec: TrainSpec | EvalSpec,
        runtime: RankRuntime,
        options: GroupOptions = GroupOptions(),
        slots: Sequence[RankSlot] | None = None,
        *,
        owner: RankGroup[Any] | None = None,
    ) -> None:
        """Prefer :meth:`start_training` / :meth:`start_eval` / :meth:`start_view`, which also
        type the stack."""
        if not ray.is_initialized():
            raise RayGroupError(
                "Ray is not running: call ray.init(...) first "
                "(ray.init(address='auto') joins an existing cluster)"
            )
        self._spec = spec
        self._role: Role = spec.model.role
        self._runtime = runtime
        self._options = options
        self._handles: tuple[Any, ...] = ()
        self._nodes: tuple[RankNode, ...] = ()
        self._driver_node = ray.get_runtime_context().get_node_id()
        self._shared: _Actors = _Actors() if owner is None else owner._shared
        self._viewing = owner is not None
        self._closed = False
        parallel = spec.model.parallel
        self._world_size = parallel.world_size
        self._tp = parallel.tensor
        self._own: ClusterPlacement | None = None
        if owner is not None:
            self._handles, self._nodes, slots = owner._handles, owner._nodes, owner._slots
        if slots is None:
            request = PlacementRequest(actor_ranks=self._world_size)
            self._own = ClusterPlacement.reserve(request, timeout_s=options.setup_timeout_s)
            slots = self._own.slots("actor")
        if len(slots) != self._world_size:
            self.close()
            raise RayGroupError(
                f"{spec.model.role}: {self._world_size} ranks but {len(slots)} slots were given"
            )
        self._slots: tuple[RankSlot, ...] = tuple(slots)
        try:
            if owner is None:
                self._start(runtime)
            else:
                deadline = time.monotonic() + options.setup_timeout_s
                self._shared.layout_epoch += 1
                builds = [h.build.remote(spec) for h in self._handles]
                self._gather(builds, f"building the {self._role} stacks", deadline)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def start_training(
        spec: TrainSpec,
        runtime: RankRuntime,
        options: GroupOptions = GroupOptions(),
        slots: Sequence[RankSlot] | None = None,
    ) -> RankGroup[TrainingStack]:
        """Start the ranks and build a training stack on each."""
        return RankGroup[TrainingStack](spec, runtime, options, slots)

    @staticmethod
    def start_eval(
        spec: EvalSpec,
        runtime: RankRuntime,
        options: GroupOptions = GroupOptions(),
        slots: Sequence[RankSlot] | None = None,
    ) -> RankGroup[EvalStack]:
        """Start the ranks and build an eval stack (no optimizer state) on each."""
        return RankGroup[EvalStack](spec, runtime, options, slots)

    def start_view(self, spec: EvalSpec) -> RankGroup[EvalStack]:
        """Build the eval stack of ``spec`` on this group's ranks, beside the stack they hold (a
        view of its model, :attr:`rlcore.backends.BackendKind.model_owner`), and return the group
        that calls it (see the module's notes on views)."""
        if self._viewing:
            raise RayGroupError(f"the {self._role} is itself a view; build views on its owner")
        return RankGroup[EvalStack](spec, self._runtime, self._options, owner=self)

    # -- lifecycle -------------------------------------------------------------------------------

    def _start(self, runtime: RankRuntime) -> None:
        deadline = time.monotonic() + self._options.setup_timeout_s
        self._handles = tuple(
            ACTOR_CLASS.options(**slot.scheduling()).remote(
                rank, self._world_size, slot.threads, runtime
            )
            for rank, slot in enumerate(self._slots)
        )
        nodes: list[tuple[str, str, int | None, int]] = self._gather(
            [h.node.remote() for h in self._handles], "starting the rank actors", deadline
        )
        self._nodes = tuple(RankNode(*node) for node in nodes)
        local_ranks = _local_ranks(self._nodes, gpu=self._slots[0].gpu)
        (port,) = self._gather([self._handles[0].free_port.remote()], "picking a port", deadline)
        master_addr = nodes[0][1]
        model = self._spec.model
        self._gather(
            [
                h.setup.remote(master_addr, port, local_ranks[rank], model.parallel, model.seed)
                for rank, h in enumerate(self._handles)
            ],
            "initialising torch.distributed and each rank's parallel state",
            deadline,
        )
        self._gather(
            [h.build.remote(self._spec) for h in self._handles], "building the stacks", deadline
        )

    def close(self) -> None:
        """Kill the rank actors (and give back the slots the group reserved); a view's only
        drops its stack. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._viewing:
            self._close_view()
            return
        self._shared.gone = True
        # The ranks on this machine: what they could not free (a storage something else kept
        # alive, a stuck rank) and their watchdogs, killed with them, did not remove.
        local = [n.pid for n in self._nodes if n.node_id == self._driver_node]
        if not ray.is_initialized():  # Ray shut down already took the actors and the group with it
            remove_shared_memory(local, _RELEASE_TIMEOUT_S)
            return
        # Each rank frees its stack first. Not in a broken group, whose stuck ranks would not
        # answer.
        if not self._shared.broken:
            try:
                ray.wait(
                    [h.release.remote() for h in self._handles],
                    num_returns=len(self._handles),
                    timeout=_RELEASE_TIMEOUT_S,
                )
            except RayError:
                pass  # a dead rank: nothing to release
        for handle in self._handles:
            try:
                ray.kill(handle, no_restart=True)
            except RayError:
                pass  # already dead
        remove_shared_memory(local, _RELEASE_TIMEOUT_S)
        if self._own is not None:
            self._own.close()

    def _close_view(self) -> None:
        """A view's close: its ranks drop its stack (not in broken or killed actors)."""
        if self._shared.gone or self._shared.broken or not ray.is_initialized():
            return
        self._shared.layout_epoch += 1
        try:
            ray.wait(
                [h.release.remote(self._role) for h in self._handles],
                num_returns=len(self._handles),
                timeout=_RELEASE_TIMEOUT_S,
            )
        except RayError:
            pass  # a dead rank: nothing to release

    def __enter__(self) -> RankGroup[S]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the group is -----------------------------------------------------------------------

    @property
    def model_spec(self) -> ModelSpec:
        return self._spec.model

    @property
    def spec(self) -> TrainSpec | EvalSpec:
        return self._spec

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def tensor_parallel_size(self) -> int:
        return self._tp

    @property
    def data_parallel_size(self) -> int:
        return self._world_size // self._tp

    @property
    def nodes(self) -> tuple[RankNode, ...]:
        """Where each rank runs, rank order."""
        return self._nodes

    @property
    def slots(self) -> tuple[RankSlot, ...]:
        """The slot of each rank, rank order."""
        return self._slots

    @property
    def layout_epoch(self) -> int:
        """Counts the calls to this group's actors (its own, its views' and its owner's) that
        may have moved their stacks' parameters in memory: every call but those made
        ``in_place``. While it stays the same, a rank's parameters lie where they lay."""
        return self._shared.layout_epoch

    @contextlib.contextmanager
    def between_calls(self, what: str) -> Iterator[None]:
        """No call of another thread to this group (or to its views or its owner) runs on its
        actors inside the block, nor changes :attr:`layout_epoch`: such calls wait for it to
        end (this thread's go ahead). Raises :class:`RayGroupError`, as a call would, when the
        group is closed or broken."""
        with self._shared.calls:
            self._check_usable(what)
            yield

    @property
    def actors(self) -> tuple[object, ...]:
        """The rank actors' handles, rank order (for inspection; call through the group)."""
        return self._handles

    # -- fanning out -----------------------------------------------------------------------------

    def run_on_all_ranks(
        self, fn: Callable[Concatenate[RankContext[S], P], R], *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """Run picklable ``fn(context, *args, **kwargs)`` on every rank at once; rank order."""
        calls: dict[int, _Call] = {rank: (fn, args, kwargs) for rank in range(self._world_size)}
        return self._call_ranks(calls, f"{_name(fn)} on all ranks")

    def call_ranks(
        self,
        fn: Callable[Concatenate[RankContext[S], P], R],
        per_rank_args: Mapping[int, tuple[object, ...]],
        what: str = "",
        *,
        in_place: bool = False,
    ) -> list[R]:
        """Run ``fn(context, *per_rank_args[rank])`` on the listed ranks at once; rank order.

        An argument that is a Ray ``ObjectRef`` reaches ``fn`` as its value (put a large argument
        once with ``ray.put`` and hand the same ref to several ranks). ``in_place``: ``fn``
        leaves every parameter of the ranks' stacks where it lies in memory (it may change their
        values, as a training step does); other calls count in :attr:`layout_epoch`.
        """
        calls: dict[int, _Call] = {rank: (fn, args, {}) for rank, args in per_rank_args.items()}
        return self._call_ranks(calls, what or _name(fn), in_place=in_place)

    # -- internals -------------------------------------------------------------------------------

    def _call_ranks(
        self, calls: Mapping[int, _Call], what: str, *, in_place: bool = False
    ) -> list[Any]:
        ranks = sorted(calls)
        with self._shared.calls:
            self._check_usable(what)
            if not in_place:
                self._shared.layout_epoch += 1
            refs = [
                self._handles[r].call.remote(self._role, calls[r][0], *calls[r][1], **calls[r][2])
                for r in ranks
            ]
            timeout = self._options.call_timeout_s
            deadline = None if timeout is None else time.monotonic() + timeout
            return self._gather(refs, what, deadline, ranks)

    def _check_usable(self, what: str) -> None:
        if self._closed or self._shared.gone:
            raise RayGroupError(f"{what}: the group is closed")
        if self._shared.broken:
            raise RayGroupError(
                f"{what}: the group is broken ({self._shared.broken}); close it and start a new one"
            )

    def _gather(
        self, refs: Sequence[Any], what: str, deadline: float | None, ranks: Sequence[int] = ()
    ) -> list[Any]:
        """``ray.get`` that fails as soon as one rank fails (others may wait in a collective)."""
        rank_of = dict(zip(refs, list(ranks) or range(len(refs)), strict=True))
        pending = list(refs)
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                late = sorted(rank_of[r] for r in pending)
                self._shared.broken = f"{what}: ranks {late} did not finish in time"
                raise RankLostError(self._shared.broken + self._stacks_of(late))
            rank = rank_of[ready[0]]
            try:
                ray.get(ready[0])
            except RayTaskError as exc:
                self._check_others(pending, rank_of, f"{what} failed on rank {rank}")
                if isinstance(exc.cause, RLCoreError):
                    raise exc.cause from exc
                raise RayGroupError(f"{what} failed on rank {rank}: {exc.cause!r}") from exc
            except (RayActorError, OutOfMemoryError) as exc:
                self._shared.broken = f"{what}: rank {rank}'s actor died"
                raise RankLostError(f"{self._shared.broken}: {death(exc)}") from exc
        return list(ray.get(list(refs)))

    def _stacks_of(self, ranks: Sequence[int]) -> str:
        """Where the given ranks are stuck (their Python stacks), for a timeout's message."""
        refs = {rank: self._handles[rank].stacks.remote() for rank in ranks}
        parts = []
        for rank, ref in refs.items():
            try:
                stacks: str = ray.get(ref, timeout=_GRACE_S)
            except RayError as exc:  # GetTimeoutError included
                stacks = f"(no answer: {exc!r})"
            parts.append(f"\n--- rank {rank} is at ---\n{stacks}")
        return "".join(parts)

    def _check_others(self, pending: list[Any], rank_of: Mapping[Any, int], failure: str) -> None:
        """Give the ranks still running :data:`_GRACE_S` to finish; if they do not, the group is
        broken (they wait in a collective the failed rank never joined)."""
        if not pending:
            return
        _, busy = ray.wait(pending, num_returns=len(pending), timeout=_GRACE_S)
        if busy:
            late = sorted(rank_of[r] for r in busy)
            self._shared.broken = f"{failure} while ranks {late} kept waiting"


def _name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _local_ranks(nodes: Sequence[RankNode], *, gpu: bool) -> list[int]:
    """LOCAL_RANK per rank: its CUDA ordinal on GPUs, else its index among its node's ranks."""
    if gpu:
        return [node.gpu or 0 for node in nodes]
    seen: dict[str, int] = {}
    out = []
    for node in nodes:
        out.append(seen.get(node.node_id, 0))
        seen[node.node_id] = out[-1] + 1
    return out
