"""Stacks over Ray rank groups: what each call does on the ranks, and the backend that builds them.

:class:`RayTrainingStack` and :class:`RayEvalStack` satisfy
:class:`rlcore.protocols.TrainingStack` and :class:`rlcore.protocols.EvalStack` by fanning calls
out to a :class:`~rlcore.launch.ray.ranks.RankGroup`; the loop cannot tell them from in-process
stacks.

Data parallelism, training: split worker-side. Every rank receives the whole rollout batch (put
once in Ray's object store) and each data-parallel rank's stack trains on its own share of each
global batch (:meth:`rlcore.protocols.TrainingStack.train_step`'s contract;
:mod:`rlcore.algorithms.train_step`), so ``global_batch_size`` must be divisible by
``data_parallel_size * micro_batch_size`` (checked before any actor starts). Scoring: split
driver-side, each data-parallel rank scores its share of the samples
(:func:`rlcore.algorithms.token_budget.forward_shares`: contiguous, or by tokens with a budget),
every rank called, with an empty share too.

Weights: :mod:`rlcore.launch.ray.sending`.

:class:`RayBackend` builds one group per stack, in the slots the run's
:class:`~rlcore.launch.ray.cluster.ClusterPlacement` reserved for the stack's role (or in slots
reserved per group when it has none), but an eval stack that views a training stack's model
(:attr:`rlcore.backends.BackendKind.model_owner`), which it builds in that stack's actors
(:meth:`~rlcore.launch.ray.ranks.RankGroup.start_view`), and closes them all in
:meth:`RayBackend.close`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, TypeAlias, TypeVar, final

import ray

from rlcore.algorithms.token_budget import forward_shares, in_input_order, sequence_lengths
from rlcore.backends import RankRuntime
from rlcore.errors import CheckpointError
from rlcore.launch.ray.cluster import ClusterPlacement
from rlcore.launch.ray.ranks import GroupOptions, RankGroup, RayGroupError
from rlcore.launch.ray.sending import export_weights, forget_mappings, send_weights
from rlcore.launch.ray.worker import RankContext
from rlcore.protocols.stacks import Backend, EvalStack, HFExporter, ModelStack, TrainingStack
from rlcore.samples import ForwardRows, Sample, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, Role, TrainSpec
from rlcore.weights import WeightSink

if TYPE_CHECKING:
    import torch

__all__ = [
    "RayEvalStack",
    "RayBackend",
    "RayTrainingStack",
    "RemoteStateView",
    "export_weights",
    "forward",
    "load",
    "save",
    "save_hf",
    "send_weights",
    "state_dict_of",
    "train_step",
]

# RayBackend's default (frozen, so one shared instance is safe).
_DEFAULT_OPTIONS: Final = GroupOptions()
S = TypeVar("S", bound=ModelStack)
ModelOwner: TypeAlias = Callable[[EvalSpec], Role | None]
"""Which training stack's model an eval stack views, by role (``None``: a model of its own):
:meth:`rlcore.backends.BackendKind.owner_of` with the run's backend options."""


# -- what the calls do on a group ----------------------------------------------------------------


def forward(group: RankGroup[S], samples: Sequence[Sample]) -> list[tuple[float, ...]]:
    """Log-probs (or values) per response token, in sample order.

    Each data-parallel rank gets its share (contiguous, or by tokens with a token budget:
    :func:`~rlcore.algorithms.token_budget.forward_shares`); the tensor-parallel ranks of a
    data-parallel rank all get it, and rank ``dp * tp`` (its tensor-parallel rank 0) returns the
    answer. Every rank is called, one whose share is empty too: a backend whose forward is a
    collective over the data-parallel ranks (FSDP's gathers) needs every one of them in it
    (:func:`rlcore.algorithms.train_step.score_samples`). When every data-parallel rank's
    stack says the positions it ran (:class:`~rlcore.samples.ForwardRows`), so does the
    answer, summed over them.
    """
    tp, budget = group.tensor_parallel_size, group.model_spec.log_probs_max_tokens_per_gpu
    parts = forward_shares(sequence_lengths(samples), group.data_parallel_size, budget)
    per_rank: dict[int, tuple[object, ...]] = {}
    for dp, part in enumerate(parts):
        ref = ray.put(tuple(samples[i] for i in part))
        for t in range(tp):
            per_rank[dp * tp + t] = (ref, t == 0)
    results = group.call_ranks(_forward, per_rank, "forward", in_place=True)[::tp]
    return ForwardRows.joined(in_input_order(parts, results), results)


def train_step(group: RankGroup[TrainingStack], batch: TrainBatch) -> TrainMetrics:
    """One ``train_step`` on every rank with the whole batch; rank 0's metrics.

    The batch goes to the object store once and every rank reads it: each data-parallel rank's
    stack trains on its own share of every global batch
    (each stack splits worker-side, :mod:`rlcore.algorithms.train_step`) and reports metrics
    already reduced over data parallel.
    """
    ref = ray.put(batch)
    per_rank = {rank: (ref,) for rank in range(group.world_size)}
    return group.call_ranks(_train_step, per_rank, "train_step", in_place=True)[0]


def save(group: RankGroup[TrainingStack], path: os.PathLike[str], rollout_id: int) -> None:
    """Every rank writes its shard (model, optimizer, scheduler) and ``rollout_id``."""
    group.run_on_all_ranks(_save, os.fspath(path), rollout_id)


def save_hf(group: RankGroup[TrainingStack], folder: os.PathLike[str]) -> None:
    """Every rank takes part in the export (it gathers over tensor and expert parallel); rank 0
    writes the Hugging Face folder ``folder`` (on its machine)."""
    group.run_on_all_ranks(_save_hf, os.fspath(folder))


def load(group: RankGroup[S], path: os.PathLike[str]) -> int:
    """Every rank loads its shard from ``path``; the rollout id all of them read.

    Raises :class:`~rlcore.errors.CheckpointError` naming the ranks when they disagree.
    """
    ids = group.run_on_all_ranks(_load, os.fspath(path))
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


def state_dict_of(
    group: RankGroup[TrainingStack], part: Literal["optimizer", "scheduler"]
) -> Mapping[str, object]:
    """Rank 0's optimizer or scheduler ``state_dict()`` (a copy)."""
    (state,) = group.call_ranks(_state_dict, {0: (part,)}, f"{part} state of rank 0")
    return state


# Functions run inside the rank actors (module level, so they pickle by reference).


def _forward(
    context: RankContext[ModelStack], samples: tuple[Sample, ...], keep: bool
) -> list[tuple[float, ...]]:
    rows = context.stack.forward(samples)
    return rows if keep else []


def _train_step(context: RankContext[TrainingStack], shard: TrainBatch) -> TrainMetrics:
    return context.stack.train_step(shard)


def _save(context: RankContext[TrainingStack], path: str, rollout_id: int) -> None:
    context.stack.save(Path(path), rollout_id)


def _save_hf(context: RankContext[TrainingStack], folder: str) -> None:
    stack = context.stack
    if not isinstance(stack, HFExporter):
        raise RayGroupError(
            f"the {type(stack).__name__} on rank {context.rank} cannot write a Hugging Face folder"
        )
    stack.save_hf(Path(folder))


def _load(context: RankContext[ModelStack], path: str) -> int:
    return context.stack.load(Path(path))


def _state_dict(
    context: RankContext[TrainingStack], part: Literal["optimizer", "scheduler"]
) -> Mapping[str, object]:
    holder = context.stack.optimizer if part == "optimizer" else context.stack.scheduler
    return holder.state_dict()


# -- the stacks ----------------------------------------------------------------------------------


@final
class RemoteStateView:
    """A read-only view of rank 0's optimizer or scheduler: ``state_dict()`` fetched on each call.

    Satisfies :class:`rlcore.protocols.Optimizer` and :class:`rlcore.protocols.Scheduler`; the
    real objects stay in the actors (each rank holds the state of its own shard).
    """

    def __init__(
        self, group: RankGroup[TrainingStack], part: Literal["optimizer", "scheduler"]
    ) -> None:
        self._group = group
        self._part: Literal["optimizer", "scheduler"] = part

    def state_dict(self) -> Mapping[str, object]:
        return state_dict_of(self._group, self._part)

    def __repr__(self) -> str:
        return f"RemoteStateView({self._part} of rank 0)"


@final
class RayEvalStack:
    """An :class:`~rlcore.protocols.EvalStack` whose shards live in a group of Ray actors."""

    kind: Final = "eval"

    def __init__(self, group: RankGroup[EvalStack]) -> None:
        self._group = group

    @property
    def group(self) -> RankGroup[EvalStack]:
        """The rank actors."""
        return self._group

    @property
    def spec(self) -> ModelSpec:
        return self._group.model_spec

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return forward(self._group, samples)

    def load(self, path: Path) -> int:
        return load(self._group, path)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        send_weights(self._group, sinks)

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The full weights in the driver (see :func:`export_weights`)."""
        return export_weights(self._group)

    def close(self) -> None:
        """Kill the actors. Safe to call twice."""
        forget_mappings(self._group)
        self._group.close()


@final
class RayTrainingStack:
    """A :class:`~rlcore.protocols.TrainingStack` whose shards live in a group of Ray actors.

    ``optimizer`` and ``scheduler`` are :class:`RemoteStateView` s of rank 0's.
    """

    kind: Final = "train"

    def __init__(self, group: RankGroup[TrainingStack]) -> None:
        self._group = group
        self._optimizer = RemoteStateView(group, "optimizer")
        self._scheduler = RemoteStateView(group, "scheduler")

    @property
    def group(self) -> RankGroup[TrainingStack]:
        """The rank actors."""
        return self._group

    @property
    def spec(self) -> ModelSpec:
        return self._group.model_spec

    @property
    def optimizer(self) -> RemoteStateView:
        return self._optimizer

    @property
    def scheduler(self) -> RemoteStateView:
        return self._scheduler

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return forward(self._group, samples)

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        return train_step(self._group, batch)

    def save(self, path: Path, rollout_id: int) -> None:
        save(self._group, path, rollout_id)

    def save_hf(self, folder: Path) -> None:
        """The actor as a Hugging Face folder (:class:`~rlcore.protocols.HFExporter`), written
        by rank 0."""
        save_hf(self._group, folder)

    def load(self, path: Path) -> int:
        return load(self._group, path)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        send_weights(self._group, sinks)

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The full weights in the driver (see :func:`export_weights`)."""
        return export_weights(self._group)

    def close(self) -> None:
        """Kill the actors. Safe to call twice."""
        forget_mappings(self._group)
        self._group.close()


@final
class RayBackend:
    """A :class:`~rlcore.protocols.Backend` that runs each stack as its own group of Ray actors,
    each rank set up by ``runtime`` (a backend kind's :class:`~rlcore.backends.RankRuntime`:
    :meth:`rlcore.backends.BackendKind.rank_runtime`), which builds the rank's stack.

    Ray must already be initialised (``ray.init(...)``). With a ``placement``, each ``build_*``
    call starts the stack's ranks in the slots reserved for its role (the reference model in the
    actor's); without one, each group reserves ``spec.model.parallel.world_size`` slots of its
    own. An eval stack that ``model_owner`` says views a training stack's model is built in the
    actors of that stack (built by this backend before it), in no slots of its own.
    :meth:`close` (or leaving a ``with`` block) closes every group this backend started.
    """

    def __init__(
        self,
        runtime: RankRuntime,
        placement: ClusterPlacement | None = None,
        options: GroupOptions = _DEFAULT_OPTIONS,
        model_owner: ModelOwner | None = None,
    ) -> None:
        self._placement = placement
        self._options = options
        self._runtime = runtime
        self._model_owner = model_owner
        self._stacks: list[RayTrainingStack | RayEvalStack] = []

    def build_training_stack(self, spec: TrainSpec) -> RayTrainingStack:
        slots = self._placement.slots(spec.model.role) if self._placement is not None else None
        group = RankGroup.start_training(spec, self._runtime, self._options, slots)
        stack = RayTrainingStack(group)
        self._stacks.append(stack)
        return stack

    def build_eval_stack(self, spec: EvalSpec) -> RayEvalStack:
        owner = self._model_owner(spec) if self._model_owner is not None else None
        if owner is not None:
            group = self._training_group(owner, spec).start_view(spec)
        else:
            slots = self._placement.slots(spec.model.role) if self._placement is not None else None
            group = RankGroup.start_eval(spec, self._runtime, self._options, slots)
        stack = RayEvalStack(group)
        self._stacks.append(stack)
        return stack

    def _training_group(self, role: Role, viewer: EvalSpec) -> RankGroup[TrainingStack]:
        """The group of the training stack of ``role`` whose model ``viewer``'s stack views."""
        for stack in self._stacks:
            if isinstance(stack, RayTrainingStack) and stack.spec.role == role:
                return stack.group
        raise RayGroupError(
            f"the {viewer.model.role} is a view of the {role}'s model, built in its rank actors: "
            f"build the {role}'s training stack first"
        )

    def close(self) -> None:
        """Close every group this backend started. Safe to call twice."""
        for stack in self._stacks:
            stack.close()
        self._stacks.clear()

    def __enter__(self) -> RayBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:

    def _conforms(
        training: RayTrainingStack, evaluation: RayEvalStack, backend: RayBackend
    ) -> tuple[TrainingStack, HFExporter, EvalStack, Backend]:
        """mypy checks here that the proxies and the backend satisfy the protocols."""
        return training, training, evaluation, backend
