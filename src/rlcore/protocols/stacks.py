"""What a backend builds: the stacks (a model only, or a model that learns) and the backend.

A run holds each stack as exactly one of two kinds, :class:`EvalStack` (a model only: no optimizer
*attribute at all*, so an eval-only run that touches an optimizer does not type-check) or
:class:`TrainingStack` (a model with an optimizer, a scheduler, a training step and a save); both
are :class:`ModelStack` s, which score token sequences, load checkpoints and send their weights
(:class:`~rlcore.weights.WeightSource`). :class:`HFExporter` is the optional capability behind
``--save-hf``, and :class:`Backend` builds the stacks the planner asks for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from rlcore.samples import Sample, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore.weights import WeightSource

__all__ = [
    "Backend",
    "EvalStack",
    "HFExporter",
    "ModelStack",
    "Optimizer",
    "Scheduler",
    "StackKind",
    "TrainingStack",
]


@runtime_checkable
class Optimizer(Protocol):
    """The part of an optimizer the core relies on: its state can be saved."""

    def state_dict(self) -> Mapping[str, object]: ...


@runtime_checkable
class Scheduler(Protocol):
    """The part of an LR scheduler the core relies on: its state can be saved."""

    def state_dict(self) -> Mapping[str, object]: ...


StackKind = Literal["eval", "train"]
"""What a stack is for: ``"eval"`` (a model only) or ``"train"`` (a model that learns)."""


@runtime_checkable
class ModelStack(WeightSource, Protocol):
    """What every stack has: a model that can score token sequences, load a checkpoint and send
    its weights to an engine. Code that needs only that (pushing weights, scoring samples) asks
    for a ``ModelStack``; a run holds each stack as exactly one of its two kinds,
    :class:`EvalStack` or :class:`TrainingStack`."""

    @property
    def kind(self) -> StackKind:
        """``"eval"`` or ``"train"``: which of the two kinds this stack is."""
        ...

    @property
    def spec(self) -> ModelSpec:
        """What this stack was built from (its role says whether ``forward`` gives log-probs or
        values)."""
        ...

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        """Per response token of each sample: the token's log-probability under a policy model
        (``actor``, ``reference``), or the value estimate at that token for a ``critic``.
        Runs without gradients.

        A :class:`~rlcore.samples.ForwardRows` (a list too) also says the samples' tokens and
        the positions the pass ran (padding included), which the loop reports as the pass's
        padding fraction; :func:`~rlcore.algorithms.train_step.score_samples` returns one. A
        plain list is a whole answer too: the pass then has no padding metric."""
        ...

    def load(self, path: Path) -> int:
        """Load from a checkpoint folder written by a training stack's ``save``: the model's
        weights, and for a training stack also its optimizer and scheduler state (an eval stack
        ignores them). Returns the rollout id recorded there. Raises
        :class:`~rlcore.errors.CheckpointError` naming the path when it is missing or corrupt."""
        ...


@runtime_checkable
class EvalStack(ModelStack, Protocol):
    """A model only: no optimizer, no scheduler, no gradient buffers, no ``train_step``.

    Its ``kind`` is ``"eval"``, a training stack's is ``"train"``: the two are siblings, not
    parent and child, so a :class:`TrainingStack` is *not* an ``EvalStack`` and a backend whose
    ``build_eval_stack`` returns one does not type-check. (The loop also refuses it at run time,
    for code that is not type-checked.) Declare it in the class body: ``kind: Final = "eval"``
    (in an attrs class, ``kind: ClassVar[Literal["eval"]] = "eval"``, which is not a field).
    """

    @property
    def kind(self) -> Literal["eval"]: ...


@runtime_checkable
class TrainingStack(ModelStack, Protocol):
    """A model that learns: a :class:`ModelStack` with an optimizer, a scheduler, a training step
    and a save. Its ``kind`` is ``"train"`` (``kind: Final = "train"`` in the class body)."""

    @property
    def kind(self) -> Literal["train"]: ...

    @property
    def optimizer(self) -> Optimizer: ...

    @property
    def scheduler(self) -> Scheduler: ...

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        """Forward/backward over ``batch`` with this stack's loss, then step optimizer and schedule
        (``spec.steps_per_rollout`` times, one global batch of ``spec.global_batch_size`` samples
        each, in order). Returns the last step's metrics, those of its whole global batch.

        Every rank of a multi-rank stack is called with the *whole* batch and trains on its own
        data-parallel share of each global batch; each micro-batch's loss is divided by the
        normaliser of the whole global batch, so the update and the metrics do not depend on how
        the batch is cut. :mod:`rlcore.algorithms.train_step` does that arithmetic for every
        backend (:func:`~rlcore.algorithms.train_step.optimizer_step_batches`,
        :func:`~rlcore.algorithms.train_step.step_micro_batches`, by sample count or by
        ``spec.max_tokens_per_gpu``, :class:`~rlcore.algorithms.train_step.StepMetrics`).
        ``sequence_tokens`` and ``padded_tokens`` of the result, when set, are the whole call's
        (:func:`~rlcore.algorithms.train_step.step_tokens`).

        The parameters change in place: a training step leaves each where it lies in memory, as
        :meth:`forward` does (a weight sync may keep views of them from one step to the next:
        :mod:`rlcore.launch.ray.sending`)."""
        ...

    def save(self, path: Path, rollout_id: int) -> None:
        """Write model, optimizer and scheduler state and ``rollout_id`` into the folder ``path``.
        The caller has created ``path`` (an empty folder inside a temporary checkpoint folder,
        which it later moves into place atomically)."""
        ...


@runtime_checkable
class HFExporter(Protocol):
    """A training stack that can also write its model as a Hugging Face folder, for
    ``--save-hf`` (an optional capability: a run asking for it refuses a stack without it before
    training starts)."""

    def save_hf(self, folder: Path) -> None:
        """Write the model's weights (safetensors) and ``config.json`` into the folder ``folder``,
        in the dtype the model trains in, so that
        ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads it. The caller has
        created ``folder`` (empty, inside a temporary folder it later moves into place) and adds
        the tokenizer's files itself."""
        ...


class Backend(Protocol):
    """Builds stacks. The planner decides what to build; a backend only knows how.

    Contract: ``build_eval_stack`` returns an :class:`EvalStack` (a model only: no optimizer
    state, no gradient buffers, ``kind == "eval"``), never a training stack; the loop refuses one
    that exposes an optimizer, a scheduler or a ``train_step`` with a
    :class:`~rlcore.errors.BackendContractError` naming the backend.
    Both methods raise :class:`~rlcore.errors.RLCoreError` subclasses, never backend internals.
    """

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack: ...

    def build_eval_stack(self, spec: EvalSpec) -> EvalStack: ...
