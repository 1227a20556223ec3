"""One rank of a :class:`~rlcore.launch.ray.ranks.RankGroup`, as the Ray actor that runs it:
where it is, its share of the process group (the environment ``torch.distributed`` reads, then
the backend kind's :class:`~rlcore.backends.RankRuntime`), its stacks, the calls fanned out to it
(each given a :class:`RankContext`), and its threads' stacks when a call is stuck (answered from
a second concurrency group). Its watchdog kills what the rank started when it dies.

A rank holds one stack, or beside it the eval stacks that view its model
(:attr:`rlcore.backends.BackendKind.model_owner`): each stack under its role, all built by one
backend (the runtime's, made on the first build), which is how a view finds the model it views.
Calls name the role of the stack they go to."""

from __future__ import annotations

import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar, final

import attrs
import ray

from rlcore.backends import RankRuntime
from rlcore.engines.hosts import free_port
from rlcore.launch.ray.cluster import cuda_ordinal
from rlcore.launch.watchdog import watch_group
from rlcore.protocols.stacks import Backend, ModelStack
from rlcore.specs import EvalSpec, ParallelSpec, Role, TrainSpec
from rlcore.weights import release_sender_resources

__all__ = ["ACTOR_CLASS", "DIAGNOSTICS", "RankContext", "RankWorker"]

S_co = TypeVar("S_co", bound=ModelStack, covariant=True)

DIAGNOSTICS: Final = "diagnostics"
"""The actors' second concurrency group: a late rank can still say where it is stuck."""


@final
@attrs.frozen
class RankContext(Generic[S_co]):
    """What a function run inside a rank's actor gets as its first argument
    (:meth:`~rlcore.launch.ray.ranks.RankGroup.call_ranks`,
    :meth:`~rlcore.launch.ray.ranks.RankGroup.run_on_all_ranks`)."""

    rank: int
    world_size: int
    local_rank: int
    tensor_parallel_rank: int
    data_parallel_rank: int
    stack: S_co


@final
class RankWorker:
    """The actor class: one rank. Driven only by :class:`~rlcore.launch.ray.ranks.RankGroup`."""

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
        self._backend: Backend | None = None
        self._contexts: dict[Role, RankContext[ModelStack]] = {}

    def node(self) -> tuple[str, str, int | None, int]:
        """(node id, node IP, the CUDA ordinal of the GPU Ray gave this actor if any, pid)."""
        context = ray.get_runtime_context()
        gpus = context.get_accelerator_ids().get("GPU", [])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ordinal = cuda_ordinal(str(gpus[0]), visible) if gpus else None
        # ray leaves get_node_ip_address unannotated
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return context.get_node_id(), ip, ordinal, os.getpid()

    def free_port(self) -> int:
        return free_port("")

    def setup(
        self, master_addr: str, master_port: int, local_rank: int, parallel: ParallelSpec, seed: int
    ) -> None:
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self._rank),
            WORLD_SIZE=str(self._world_size),
            LOCAL_RANK=str(local_rank),
        )
        self._local_rank = local_rank
        self._tp = parallel.tensor
        self._runtime.init(parallel, seed)
        # OMP_NUM_THREADS was set before the process started; torch reads it on import, but say it.
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(self._threads)

    def build(self, spec: TrainSpec | EvalSpec) -> None:
        """Build the stack of ``spec`` with this rank's backend (one for all its stacks)."""
        role = spec.model.role
        if role in self._contexts:
            # An invariant of RankGroup (one group per role); it reports this as the rank's failure.
            raise RuntimeError(f"rank {self._rank} holds a {role} stack already")
        if self._backend is None:
            self._backend = self._runtime.backend()
        stack: ModelStack
        if isinstance(spec, TrainSpec):
            stack = self._backend.build_training_stack(spec)
        else:
            stack = self._backend.build_eval_stack(spec)
        self._contexts[role] = RankContext(
            rank=self._rank,
            world_size=self._world_size,
            local_rank=self._local_rank,
            tensor_parallel_rank=self._rank % self._tp,
            data_parallel_rank=self._rank // self._tp,
            stack=stack,
        )

    def call(
        self, role: Role, fn: Callable[..., object], /, *args: object, **kwargs: object
    ) -> object:
        # Arguments arrive unpacked so that Ray resolves ObjectRefs among them to their values.
        context = self._contexts.get(role)
        if context is None:
            # An invariant of RankGroup (it builds before it calls); it reports this as the
            # rank's failure.
            raise RuntimeError(f"rank {self._rank} has no {role} stack: build() did not run")
        return fn(context, *args, **kwargs)

    def release(self, role: Role | None = None) -> None:
        """Drop the stack of ``role`` (``None``: every stack, the backend, and what weight sinks
        kept here), so that their storages are freed now: on the CPU, torch then removes their
        shared-memory files, which outlive a process killed with its ``torch_shm_manager`` (as
        Ray kills an actor's children with it)."""
        if role is not None:
            self._contexts.pop(role, None)
        else:
            self._contexts.clear()
            self._backend = None
            release_sender_resources()  # what weight sinks kept here between updates
        gc.collect()

    @ray.method(concurrency_group=DIAGNOSTICS)
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
ACTOR_CLASS: Final[Any] = ray.remote(concurrency_groups={DIAGNOSTICS: 1})(  # type: ignore[call-overload]
    RankWorker
)
"""An ``ActorClass`` whose methods, but :meth:`RankWorker.stacks`, run one call at a time."""
