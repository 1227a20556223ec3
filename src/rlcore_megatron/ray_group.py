"""One Ray actor per Megatron rank, in one placement group: :class:`RayTrainGroup`.

A group is ``ParallelSpec.world_size`` actors of one worker class. Each actor is one
``torch.distributed`` rank (gloo on the CPU, nccl on GPUs, as
:func:`rlcore_megatron.parallel.init_megatron` picks) and holds its shard of one stack, built by
:class:`~rlcore_megatron.backend.MegatronBackend` inside the actor. The driver never holds model
weights; it fans a call out to every rank and gathers the results.

How a group comes up, in order:

1. a placement group of one bundle per rank (``{"CPU": cpus_per_rank}``, plus ``{"GPU": 1}`` on
   GPU clusters), ``STRICT_PACK`` on one node by default, reserved before any actor starts;
2. one actor per bundle; rank ``r`` goes in bundle ``r``;
3. rank 0 picks a free TCP port on its node; every rank gets ``MASTER_ADDR`` (rank 0's node IP),
   ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in its environment and calls the
   runtime's ``init`` (``init_megatron``) concurrently, so the rendezvous can complete;
4. every rank builds its stack from the spec.

Threads: unless ``OMP_NUM_THREADS`` is already set, Ray sets it in an actor's process to the
actor's ``num_cpus`` rounded down (at least 1; 1 when it asks for none), and torch sizes its
intra-op pool from it. A rank's thread count is set deliberately instead: to
``GroupOptions.threads_per_rank`` when given, else to ``cpus_per_rank`` rounded down (at least 1),
in ``OMP_NUM_THREADS`` before the process starts (so Ray leaves it alone) and with
``torch.set_num_threads`` once the rank is initialised.

GPUs: a GPU rank's actor keeps every GPU of its node visible
(``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``) and gets ``LOCAL_RANK`` = the CUDA ordinal Ray
assigned to it, which is the device ``init_megatron`` selects. On the CPU ``LOCAL_RANK`` is the
rank's index among the group's ranks on its node.

Layout: Megatron's default rank order puts tensor parallel fastest, so rank ``r`` is
tensor-parallel rank ``r % tp`` of data-parallel rank ``r // tp``.

Lifetime: each rank's actor starts a watchdog (:func:`~rlcore_megatron.watchdog.watch_group`)
that kills the processes the rank started when the rank dies, however it dies.

Failures: a call fails as soon as one rank fails. Errors a stack raises on purpose (an
:class:`~rlcore.errors.RLCoreError`) reach the caller as themselves; anything else becomes a
:class:`RayGroupError` naming the rank. When a rank's actor died, a call timed out, or other
ranks were still busy (stuck in a collective) after a failure, the group is *broken*: later calls
raise at once, and the only way on is :meth:`RayTrainGroup.close` and a new group. A timeout's
error carries the late ranks' Python stacks, read through the actors' second concurrency group.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Final,
    Generic,
    Literal,
    ParamSpec,
    Protocol,
    TypeVar,
    final,
)

import attrs
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlcore.errors import CheckpointError, RLCoreError
from rlcore.protocols import Backend, EvalStack, TrainingStack
from rlcore.samples import Sample, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore_megatron.watchdog import watch_group

if TYPE_CHECKING:
    import torch

__all__ = [
    "GroupOptions",
    "MegatronRuntime",
    "PlacementStrategy",
    "RankContext",
    "RankRuntime",
    "RayGroupError",
    "RayTrainGroup",
    "split_evenly",
]

PlacementStrategy = Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"]

S = TypeVar("S", bound=EvalStack)
S_co = TypeVar("S_co", bound=EvalStack, covariant=True)
R = TypeVar("R")
T = TypeVar("T")
_Call = tuple[Callable[..., Any], tuple[object, ...], dict[str, Any]]
P = ParamSpec("P")

_NOSET_CUDA: Final = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class RayGroupError(RLCoreError):
    """A Ray rank group could not start, a rank's actor died, or a call on it failed or timed out.

    Errors the stacks raise on purpose (a :class:`~rlcore.errors.CheckpointError`, ...) pass
    through as themselves; this wraps everything else, ``from`` Ray's exception.
    """


_GRACE_S: Final = 10.0
"""After one rank fails, how long the others get to finish before the group counts as broken."""
_DIAGNOSTICS: Final = "diagnostics"
"""The actors' second concurrency group: a late rank can still say where it is stuck."""


class RankRuntime(Protocol):
    """What runs inside each rank's actor before its stack exists. Must be picklable.

    ``init`` is called on every rank at once, with ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK`` already in ``os.environ``; ``backend`` then builds the
    rank's stack. :class:`MegatronRuntime` is the real one; tests may pass a light stand-in.
    """

    def init(self, tensor_parallel_size: int, seed: int, expert_parallel_size: int = 1) -> None: ...

    def backend(self) -> Backend: ...


@final
@attrs.frozen
class MegatronRuntime:
    """``init_megatron``, then a :class:`~rlcore_megatron.backend.MegatronBackend`.

    Both are imported inside the actor: the driver never imports Megatron.
    """

    def init(self, tensor_parallel_size: int, seed: int, expert_parallel_size: int = 1) -> None:
        from rlcore_megatron.parallel import init_megatron

        init_megatron(tensor_parallel_size, seed, expert_parallel_size)

    def backend(self) -> Backend:
        from rlcore_megatron.backend import MegatronBackend

        return MegatronBackend()


@final
@attrs.frozen
class GroupOptions:
    """How a group claims resources. The defaults suit one CPU node."""

    cpus_per_rank: float = 1.0
    """Logical CPUs reserved for each rank (its bundle's ``CPU``)."""
    gpus_per_rank: Literal[0, 1] = 0
    """1 on GPU clusters: each rank's bundle also holds one ``GPU``."""
    threads_per_rank: int | None = None
    """torch intra-op threads per rank; ``None``: ``cpus_per_rank`` rounded down, at least 1."""
    strategy: PlacementStrategy = "STRICT_PACK"
    """Ray placement strategy for the bundles; ``STRICT_PACK`` keeps all ranks on one node."""
    setup_timeout_s: float = 600.0
    """Limit for reserving the bundles, starting the actors and building the stacks."""
    call_timeout_s: float | None = None
    """Limit for one fanned-out call (``None``: none; a failed rank still fails a call at once)."""

    def __attrs_post_init__(self) -> None:
        if self.cpus_per_rank <= 0:
            raise ValueError(f"GroupOptions.cpus_per_rank must be > 0, got {self.cpus_per_rank}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(
                f"GroupOptions.threads_per_rank must be >= 1, got {self.threads_per_rank}"
            )

    @property
    def threads(self) -> int:
        """The torch thread count each rank uses."""
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        return max(1, int(self.cpus_per_rank))

    def bundle(self) -> dict[str, float]:
        """One rank's placement-group bundle."""
        if self.gpus_per_rank:
            return {"CPU": self.cpus_per_rank, "GPU": float(self.gpus_per_rank)}
        return {"CPU": self.cpus_per_rank}


@final
@attrs.frozen
class RankContext(Generic[S_co]):
    """What a function run inside a rank's actor gets as its first argument
    (:meth:`RayTrainGroup.run_on_all_ranks`, :meth:`RayTrainGroup.call_ranks`)."""

    rank: int
    world_size: int
    local_rank: int
    tensor_parallel_rank: int
    data_parallel_rank: int
    stack: S_co


@final
class _RankWorker:
    """The actor class: one Megatron rank. Driven only by :class:`RayTrainGroup`."""

    def __init__(self, rank: int, world_size: int, threads: int, runtime: RankRuntime) -> None:
        # What this rank starts (Megatron's checkpoint writer starts a multiprocessing manager)
        # dies with it, even when Ray kills it because the driver was killed.
        self._watchdog = watch_group()
        self._threads = threads
        self._rank = rank
        self._world_size = world_size
        self._runtime = runtime
        self._local_rank = 0
        self._tp = 1
        self._context: RankContext[EvalStack] | None = None

    def node(self) -> tuple[str, str, int | None]:
        """(node id, node IP, the CUDA ordinal of the GPU Ray assigned to this actor, if any)."""
        context = ray.get_runtime_context()
        gpus = context.get_accelerator_ids().get("GPU", [])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ordinal = _cuda_ordinal(str(gpus[0]), visible) if gpus else None
        # ray leaves get_node_ip_address unannotated
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return context.get_node_id(), ip, ordinal

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port: int = sock.getsockname()[1]
            return port

    def setup(
        self, master_addr: str, master_port: int, local_rank: int, tp: int, seed: int, ep: int = 1
    ) -> None:
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self._rank),
            WORLD_SIZE=str(self._world_size),
            LOCAL_RANK=str(local_rank),
        )
        self._local_rank = local_rank
        self._tp = tp
        self._runtime.init(tp, seed, ep)
        # OMP_NUM_THREADS was set before the process started; torch reads it on import, but say it.
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(self._threads)

    def build(self, spec: TrainSpec | EvalSpec) -> None:
        backend = self._runtime.backend()
        stack: EvalStack
        if isinstance(spec, TrainSpec):
            stack = backend.build_training_stack(spec)
        else:
            stack = backend.build_eval_stack(spec)
        self._context = RankContext(
            rank=self._rank,
            world_size=self._world_size,
            local_rank=self._local_rank,
            tensor_parallel_rank=self._rank % self._tp,
            data_parallel_rank=self._rank // self._tp,
            stack=stack,
        )

    def call(self, fn: Callable[..., object], /, *args: object, **kwargs: object) -> object:
        # Arguments arrive unpacked so that Ray resolves ObjectRefs among them to their values.
        if self._context is None:
            raise RayGroupError(f"rank {self._rank} has no stack yet: build() did not run")
        return fn(self._context, *args, **kwargs)

    @ray.method(concurrency_group=_DIAGNOSTICS)
    def stacks(self) -> str:
        """Every thread's Python stack: answered from its own thread while a call is stuck."""
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        return "\n".join(
            f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()
            if ident != me
        )


# Ray's typed overloads of ray.remote omit concurrency_groups, which it accepts for actor classes.
_ACTOR_CLASS: Final[Any] = ray.remote(concurrency_groups={_DIAGNOSTICS: 1})(  # type: ignore[call-overload]
    _RankWorker
)
"""An ``ActorClass`` whose methods, but :meth:`_RankWorker.stacks`, run one call at a time."""


@final
class RayTrainGroup(Generic[S]):
    """``spec.model.parallel.world_size`` Megatron ranks as Ray actors; calls fanned out to them.

    Build one with :meth:`start_training` or :meth:`start_eval` (Ray must be initialised). Every
    method that touches the model calls all ranks concurrently (each takes part in the
    collectives) and waits until all are done or one fails (see the module's notes on failures).
    :meth:`close` kills the actors and removes the placement group; it is safe to call twice.
    """

    def __init__(
        self,
        spec: TrainSpec | EvalSpec,
        options: GroupOptions = GroupOptions(),
        runtime: RankRuntime = MegatronRuntime(),
    ) -> None:
        """Prefer :meth:`start_training` / :meth:`start_eval`, which also type the stack."""
        if not ray.is_initialized():
            raise RayGroupError(
                "Ray is not running: call ray.init(...) first "
                "(ray.init(address='auto') joins an existing cluster)"
            )
        self._spec = spec
        self._options = options
        self._handles: tuple[Any, ...] = ()
        self._broken = ""
        self._closed = False
        parallel = spec.model.parallel
        self._world_size = parallel.world_size
        self._tp = parallel.tensor_model_parallel_size
        self._pg: PlacementGroup = placement_group(
            [options.bundle() for _ in range(self._world_size)], strategy=options.strategy
        )
        try:
            self._start(runtime)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def start_training(
        spec: TrainSpec,
        options: GroupOptions = GroupOptions(),
        runtime: RankRuntime = MegatronRuntime(),
    ) -> RayTrainGroup[TrainingStack]:
        """Start the ranks and build a training stack on each."""
        return RayTrainGroup[TrainingStack](spec, options, runtime)

    @staticmethod
    def start_eval(
        spec: EvalSpec,
        options: GroupOptions = GroupOptions(),
        runtime: RankRuntime = MegatronRuntime(),
    ) -> RayTrainGroup[EvalStack]:
        """Start the ranks and build an eval stack (no optimizer state) on each."""
        return RayTrainGroup[EvalStack](spec, options, runtime)

    # -- lifecycle -------------------------------------------------------------------------------

    def _start(self, runtime: RankRuntime) -> None:
        options = self._options
        deadline = time.monotonic() + options.setup_timeout_s
        try:
            ray.get(self._pg.ready(), timeout=options.setup_timeout_s)
        except GetTimeoutError as exc:
            raise RayGroupError(
                f"could not reserve {self._world_size} bundles of {options.bundle()} "
                f"({options.strategy}) within {options.setup_timeout_s}s; "
                f"the cluster has {_resources()}"
            ) from exc
        env = {"OMP_NUM_THREADS": str(options.threads)}
        if options.gpus_per_rank:
            env[_NOSET_CUDA] = "1"
        self._handles = tuple(
            _ACTOR_CLASS.options(
                num_cpus=options.cpus_per_rank,
                num_gpus=options.gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env},
            ).remote(rank, self._world_size, options.threads, runtime)
            for rank in range(self._world_size)
        )
        nodes: list[tuple[str, str, int | None]] = self._gather(
            [h.node.remote() for h in self._handles], "starting the rank actors", deadline
        )
        local_ranks = _local_ranks(nodes, gpu=bool(options.gpus_per_rank))
        (port,) = self._gather([self._handles[0].free_port.remote()], "picking a port", deadline)
        master_addr = nodes[0][1]
        seed = self._spec.model.seed
        ep = self._spec.model.parallel.expert_model_parallel_size
        self._gather(
            [
                h.setup.remote(master_addr, port, local_ranks[rank], self._tp, seed, ep)
                for rank, h in enumerate(self._handles)
            ],
            "initialising torch.distributed and Megatron",
            deadline,
        )
        self._gather(
            [h.build.remote(self._spec) for h in self._handles], "building the stacks", deadline
        )

    def close(self) -> None:
        """Kill the rank actors and remove the placement group. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if not ray.is_initialized():  # Ray shut down already took the actors and the group with it
            return
        for handle in self._handles:
            try:
                ray.kill(handle, no_restart=True)
            except RayError:
                pass  # already dead
        remove_placement_group(self._pg)

    def __enter__(self) -> RayTrainGroup[S]:
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
    def data_parallel_size(self) -> int:
        return self._world_size // self._tp

    @property
    def placement_group(self) -> PlacementGroup:
        return self._pg

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
    ) -> list[R]:
        """Run ``fn(context, *per_rank_args[rank])`` on the listed ranks at once; rank order.

        An argument that is a Ray ``ObjectRef`` reaches ``fn`` as its value (put a large argument
        once with ``ray.put`` and hand the same ref to several ranks).
        """
        calls: dict[int, _Call] = {rank: (fn, args, {}) for rank, args in per_rank_args.items()}
        return self._call_ranks(calls, what or _name(fn))

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        """Log-probs (or values) per response token, in sample order.

        The samples are split into contiguous, near-equal parts, one per data-parallel rank; the
        tensor-parallel ranks of a data-parallel rank all get its part, and rank ``dp * tp`` (its
        tensor-parallel rank 0) returns the answer. A data-parallel rank with no part is not called.
        """
        parts = split_evenly(tuple(samples), self.data_parallel_size)
        per_rank: dict[int, tuple[object, ...]] = {}
        for dp, part in enumerate(parts):
            if part:
                ref = ray.put(part)
                for tp in range(self._tp):
                    per_rank[dp * self._tp + tp] = (ref, tp == 0)
        results = self.call_ranks(_forward, per_rank, "forward")
        return [row for rows in results for row in rows]

    def train_step(self: RayTrainGroup[TrainingStack], batch: TrainBatch) -> TrainMetrics:
        """One ``train_step`` on every rank with the whole batch; rank 0's metrics.

        The batch goes to the object store once and every rank reads it: each data-parallel rank's
        stack trains on its own contiguous slice of every global batch
        (:class:`~rlcore_megatron.stacks.MegatronTrainingStack` splits worker-side) and reports
        metrics already reduced over data parallel.
        """
        ref = ray.put(batch)
        per_rank = {rank: (ref,) for rank in range(self._world_size)}
        return self.call_ranks(_train_step, per_rank, "train_step")[0]

    def save(self: RayTrainGroup[TrainingStack], path: os.PathLike[str], rollout_id: int) -> None:
        """Every rank writes its shard (model, optimizer, scheduler) and ``rollout_id``."""
        self.run_on_all_ranks(_save, os.fspath(path), rollout_id)

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The full weights under Hugging Face names, gathered over tensor parallel, from rank 0.

        Every rank takes part in the gather; only rank 0's tensors cross to the driver.
        """
        per_rank: dict[int, tuple[object, ...]] = {r: (r == 0,) for r in range(self._world_size)}
        return self.call_ranks(_export_weights, per_rank, "export_weights")[0]

    def state_dict_of(
        self: RayTrainGroup[TrainingStack], part: Literal["optimizer", "scheduler"]
    ) -> Mapping[str, object]:
        """Rank 0's optimizer or scheduler ``state_dict()`` (a copy); no collective, so only
        rank 0 is called."""
        (state,) = self.call_ranks(_state_dict, {0: (part,)}, f"{part} state_dict on rank 0")
        return state

    def load(self, path: os.PathLike[str]) -> int:
        """Every rank loads its shard from ``path``; the rollout id all of them read.

        Raises :class:`~rlcore.errors.CheckpointError` naming the ranks when they disagree.
        """
        ids = self.run_on_all_ranks(_load, os.fspath(path))
        if len(set(ids)) > 1:
            by_id: dict[int, list[int]] = {}
            for rank, rollout_id in enumerate(ids):
                by_id.setdefault(rollout_id, []).append(rank)
            parts = "; ".join(
                f"ranks {ranks} read rollout id {rid}" for rid, ranks in sorted(by_id.items())
            )
            raise CheckpointError(
                f"the ranks disagree on the rollout id recorded in {path}: {parts}. "
                "Its shards come from different saves; point the run at one complete checkpoint."
            )
        return ids[0]

    # -- internals -------------------------------------------------------------------------------

    def _call_ranks(self, calls: Mapping[int, _Call], what: str) -> list[Any]:
        if self._closed:
            raise RayGroupError(f"{what}: the group is closed")
        if self._broken:
            raise RayGroupError(
                f"{what}: the group is broken ({self._broken}); close it and start a new one"
            )
        ranks = sorted(calls)
        refs = [
            self._handles[r].call.remote(calls[r][0], *calls[r][1], **calls[r][2]) for r in ranks
        ]
        timeout = self._options.call_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._gather(refs, what, deadline, ranks)

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
                self._broken = f"{what}: ranks {late} did not finish in time"
                raise RayGroupError(self._broken + self._stacks_of(late))
            rank = rank_of[ready[0]]
            try:
                ray.get(ready[0])
            except RayTaskError as exc:
                self._check_others(pending, rank_of, f"{what} failed on rank {rank}")
                if isinstance(exc.cause, RLCoreError):
                    raise exc.cause from exc
                raise RayGroupError(f"{what} failed on rank {rank}: {exc.cause!r}") from exc
            except RayActorError as exc:
                self._broken = f"{what}: rank {rank}'s actor died"
                raise RayGroupError(f"{self._broken}: {exc}") from exc
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
            self._broken = f"{failure} while ranks {sorted(rank_of[r] for r in busy)} kept waiting"


def _resources() -> str:
    # ray leaves these two unannotated
    total = ray.cluster_resources()  # type: ignore[no-untyped-call]
    free = ray.available_resources()  # type: ignore[no-untyped-call]
    return f"{total} of which {free} are free"


def _name(fn: Callable[..., object]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


def _cuda_ordinal(gpu_id: str, visible: str | None) -> int:
    """The CUDA device index of Ray's GPU ``gpu_id`` in a process that sees ``visible`` (the
    node's ``CUDA_VISIBLE_DEVICES``, which Ray's ids refer to when it is set)."""
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if gpu_id in ids:
            return ids.index(gpu_id)
    return int(gpu_id)


def _local_ranks(nodes: Sequence[tuple[str, str, int | None]], *, gpu: bool) -> list[int]:
    """LOCAL_RANK per rank: its CUDA ordinal on GPUs, else its index among its node's ranks."""
    if gpu:
        return [ordinal or 0 for _, _, ordinal in nodes]
    seen: dict[str, int] = {}
    out = []
    for node_id, _, _ in nodes:
        out.append(seen.get(node_id, 0))
        seen[node_id] = out[-1] + 1
    return out


def split_evenly(items: tuple[T, ...], parts: int) -> list[tuple[T, ...]]:
    """``parts`` contiguous slices of ``items``, lengths differing by at most one, longer first."""
    size, extra = divmod(len(items), parts)
    out = []
    start = 0
    for i in range(parts):
        stop = start + size + (i < extra)
        out.append(items[start:stop])
        start = stop
    return out


# Functions run inside the rank actors (module level, so they pickle by reference).


def _forward(
    context: RankContext[EvalStack], samples: tuple[Sample, ...], keep: bool
) -> list[tuple[float, ...]]:
    rows = context.stack.forward(samples)
    return rows if keep else []


def _train_step(context: RankContext[TrainingStack], shard: TrainBatch) -> TrainMetrics:
    return context.stack.train_step(shard)


def _save(context: RankContext[TrainingStack], path: str, rollout_id: int) -> None:
    context.stack.save(Path(path), rollout_id)


def _load(context: RankContext[EvalStack], path: str) -> int:
    return context.stack.load(Path(path))


def _export_weights(context: RankContext[EvalStack], keep: bool) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, tensor in context.stack.export_weights():  # all ranks iterate: gathers are collective
        if keep:
            out.append((name, tensor.detach().to("cpu").contiguous()))
    return out


def _state_dict(
    context: RankContext[TrainingStack], part: Literal["optimizer", "scheduler"]
) -> Mapping[str, object]:
    holder = context.stack.optimizer if part == "optimizer" else context.stack.scheduler
    return holder.state_dict()
