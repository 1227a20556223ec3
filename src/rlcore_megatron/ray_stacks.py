"""Driver-side stacks over Ray rank groups, and the backend that builds them.

:class:`RayTrainingStack` and :class:`RayEvalStack` satisfy
:class:`rlcore.protocols.TrainingStack` and :class:`rlcore.protocols.EvalStack` by calling a
:class:`~rlcore_megatron.ray_group.RayTrainGroup`; the loop cannot tell them from in-process
stacks.

Data parallelism, training: split worker-side. Every rank receives the whole rollout batch (put
once in Ray's object store) and each data-parallel rank's
:class:`~rlcore_megatron.stacks.MegatronTrainingStack` trains on its own contiguous slice of each
global batch, so ``global_batch_size`` must be divisible by
``data_parallel_size * micro_batch_size`` (a :class:`~rlcore.specs.TrainSpec` that exists is
split so). Scoring: split
driver-side, each data-parallel rank scores a contiguous part of the samples.

:class:`RayMegatronBackend` builds one group per stack, sized by ``spec.model.parallel``, and
closes them all in :meth:`RayMegatronBackend.close`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal, final

from rlcore.protocols import Backend, EvalStack, NamedTensors, TrainingStack
from rlcore.samples import Sample, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore_megatron.ray_group import GroupOptions, MegatronRuntime, RankRuntime, RayTrainGroup

__all__ = ["RayEvalStack", "RayMegatronBackend", "RayTrainingStack", "RemoteStateView"]

# RayMegatronBackend's defaults (both frozen, so one shared instance each is safe).
_DEFAULT_OPTIONS: Final = GroupOptions()
_DEFAULT_RUNTIME: Final = MegatronRuntime()


@final
class RemoteStateView:
    """A read-only view of rank 0's optimizer or scheduler: ``state_dict()`` fetched on each call.

    Satisfies :class:`rlcore.protocols.Optimizer` and :class:`rlcore.protocols.Scheduler`; the
    real objects stay in the actors (each rank holds the state of its own shard).
    """

    def __init__(
        self, group: RayTrainGroup[TrainingStack], part: Literal["optimizer", "scheduler"]
    ) -> None:
        self._group = group
        self._part: Literal["optimizer", "scheduler"] = part

    def state_dict(self) -> Mapping[str, object]:
        return self._group.state_dict_of(self._part)

    def __repr__(self) -> str:
        return f"RemoteStateView({self._part} of rank 0)"


@final
class RayEvalStack:
    """An :class:`~rlcore.protocols.EvalStack` whose shards live in a group of Ray actors."""

    def __init__(self, group: RayTrainGroup[EvalStack]) -> None:
        self._group = group

    @property
    def group(self) -> RayTrainGroup[EvalStack]:
        """The rank actors (for :meth:`~RayTrainGroup.run_on_all_ranks` and friends)."""
        return self._group

    @property
    def spec(self) -> ModelSpec:
        return self._group.model_spec

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        return self._group.forward(samples)

    def load(self, path: Path) -> int:
        return self._group.load(path)

    def export_weights(self) -> NamedTensors:
        return self._group.export_weights()

    def close(self) -> None:
        """Kill the actors and free their placement group. Safe to call twice."""
        self._group.close()


@final
class RayTrainingStack:
    """A :class:`~rlcore.protocols.TrainingStack` whose shards live in a group of Ray actors.

    ``optimizer`` and ``scheduler`` are :class:`RemoteStateView` s of rank 0's.
    """

    def __init__(self, group: RayTrainGroup[TrainingStack]) -> None:
        self._group = group
        self._optimizer = RemoteStateView(group, "optimizer")
        self._scheduler = RemoteStateView(group, "scheduler")

    @property
    def group(self) -> RayTrainGroup[TrainingStack]:
        """The rank actors (for :meth:`~RayTrainGroup.run_on_all_ranks` and friends)."""
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
        return self._group.forward(samples)

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        return self._group.train_step(batch)

    def save(self, path: Path, rollout_id: int) -> None:
        self._group.save(path, rollout_id)

    def load(self, path: Path) -> int:
        return self._group.load(path)

    def export_weights(self) -> NamedTensors:
        return self._group.export_weights()

    def close(self) -> None:
        """Kill the actors and free their placement group. Safe to call twice."""
        self._group.close()


@final
class RayMegatronBackend:
    """A :class:`~rlcore.protocols.Backend` that runs each stack as its own group of Ray actors.

    Ray must already be initialised (``ray.init(...)``). Each ``build_*`` call reserves
    ``spec.model.parallel.world_size`` bundles of ``options`` and builds the stack in them;
    :meth:`close` (or leaving a ``with`` block) closes every group this backend started.
    """

    def __init__(
        self, options: GroupOptions = _DEFAULT_OPTIONS, runtime: RankRuntime = _DEFAULT_RUNTIME
    ) -> None:
        self._options = options
        self._runtime = runtime
        self._stacks: list[RayTrainingStack | RayEvalStack] = []

    def build_training_stack(self, spec: TrainSpec) -> RayTrainingStack:
        stack = RayTrainingStack(RayTrainGroup.start_training(spec, self._options, self._runtime))
        self._stacks.append(stack)
        return stack

    def build_eval_stack(self, spec: EvalSpec) -> RayEvalStack:
        stack = RayEvalStack(RayTrainGroup.start_eval(spec, self._options, self._runtime))
        self._stacks.append(stack)
        return stack

    def close(self) -> None:
        """Close every group this backend started. Safe to call twice."""
        for stack in self._stacks:
            stack.close()
        self._stacks.clear()

    def __enter__(self) -> RayMegatronBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:

    def _conforms(
        training: RayTrainingStack, evaluation: RayEvalStack, backend: RayMegatronBackend
    ) -> tuple[TrainingStack, EvalStack, Backend]:
        """mypy checks here that the proxies and the backend satisfy the protocols."""
        return training, evaluation, backend
