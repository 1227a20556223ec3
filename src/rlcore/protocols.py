"""The contracts between the core and the things it drives. Everything the loop needs is here.

Implementations satisfy these structurally (no base classes); concrete classes are ``@final`` and
share code through functions. No method returns ``Optional`` and none takes a mode flag: what a
stack can do is what its type says. An :class:`EvalStack` has no optimizer *attribute at all*, so
an eval-only run that touches an optimizer does not type-check.

Tensors appear only in weight transfer and only for the type checker: ``import rlcore`` does not
import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from rlcore.samples import Generation, Prompt, Sample, SamplingParams, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec

if TYPE_CHECKING:
    import torch

    from rlcore.rollout import RolloutContext, RolloutOutput

__all__ = [
    "Backend",
    "EvalStack",
    "GroupFilter",
    "MetricsSink",
    "NamedTensors",
    "Optimizer",
    "PromptSource",
    "RewardFn",
    "RolloutEngine",
    "RolloutFn",
    "Scheduler",
    "TrainingStack",
]

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]
"""Weights under Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``)."""


@runtime_checkable
class Optimizer(Protocol):
    """The part of an optimizer the core relies on: its state can be saved."""

    def state_dict(self) -> Mapping[str, object]: ...


@runtime_checkable
class Scheduler(Protocol):
    """The part of an LR scheduler the core relies on: its state can be saved."""

    def state_dict(self) -> Mapping[str, object]: ...


@runtime_checkable
class EvalStack(Protocol):
    """A model that can score token sequences, load a checkpoint and export its weights.

    No optimizer, no scheduler, no gradient buffers.
    """

    @property
    def spec(self) -> ModelSpec:
        """What this stack was built from (its role says whether ``forward`` gives log-probs or
        values)."""
        ...

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        """Per response token of each sample: the token's log-probability under a policy model
        (``actor``, ``reference``), or the value estimate at that token for a ``critic``.
        Runs without gradients."""
        ...

    def load(self, path: Path) -> int:
        """Load model weights from a checkpoint folder written by a training stack's ``save``
        (optimizer state, if any, is ignored). Returns the rollout id recorded there.
        Raises :class:`~rlcore.errors.CheckpointError` naming the path when it is missing or
        corrupt."""
        ...

    def export_weights(self) -> NamedTensors:
        """The full (unsharded) weights under Hugging Face names, for a rollout engine."""
        ...


@runtime_checkable
class TrainingStack(EvalStack, Protocol):
    """An :class:`EvalStack` that can also learn and save."""

    @property
    def optimizer(self) -> Optimizer: ...

    @property
    def scheduler(self) -> Scheduler: ...

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        """Forward/backward over ``batch`` with this stack's loss, then step optimizer and schedule
        (``spec.steps_per_rollout`` times, one global batch each). Returns the last step's
        metrics."""
        ...

    def save(self, path: Path, rollout_id: int) -> None:
        """Write model, optimizer and scheduler state and ``rollout_id`` into the folder ``path``
        (which the caller creates and later moves into place atomically)."""
        ...


class Backend(Protocol):
    """Builds stacks. The planner decides what to build; a backend only knows how.

    Contract: ``build_eval_stack`` allocates no optimizer state and no gradient buffers.
    Both methods raise :class:`~rlcore.errors.RLCoreError` subclasses, never backend internals.
    """

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack: ...

    def build_eval_stack(self, spec: EvalSpec) -> EvalStack: ...


class RolloutEngine(Protocol):
    """Generates responses from the current policy weights.

    ``generate`` returns exactly one :class:`Generation` per prompt, in order (repeat a prompt to
    sample it several times). ``update_weights`` replaces the engine's weights with the given
    tensors and records ``version``; later generations carry that version. Failures raise
    :class:`~rlcore.errors.RolloutError`; nothing waits forever.
    """

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]: ...

    def update_weights(self, weights: NamedTensors, version: int) -> None: ...

    @property
    def weight_version(self) -> int: ...

    def close(self) -> None:
        """Release servers, processes and memory. Safe to call twice."""
        ...


class RewardFn(Protocol):
    """Scores one generation for one prompt. ``prompt.label`` holds the reference answer.

    The parameters are positional-only: any callable taking a prompt and a generation fits,
    whatever it names them (``def reward(p, g)``)."""

    def __call__(self, prompt: Prompt, generation: Generation, /) -> float: ...


class PromptSource(Protocol):
    """Where a rollout draws its prompts from (the run's :class:`~rlcore.data.PromptSampler`)."""

    def take(self, n: int) -> tuple[Prompt, ...]:
        """The next ``n`` prompts of the run's stream. Its position is what checkpoints record,
        so resuming continues the stream exactly."""
        ...


class GroupFilter(Protocol):
    """Dynamic sampling's judge (``--dynamic-sampling-filter-path``): whether a prompt's group of
    scored samples is worth training on (DAPO drops groups whose rewards all equal, as their
    group-normalised advantages are all 0)."""

    def __call__(self, group: Sequence[Sample], /) -> bool: ...


class RolloutFn(Protocol):
    """The rollout seam (slime's rollout function, ``--rollout-function-path``): everything that
    turns prompts into the groups one rollout trains on.

    It receives a :class:`~rlcore.rollout.RolloutContext` (rollout id, prompt source, engine,
    reward function, sampling parameters, the groups wanted, dynamic-sampling settings and the
    groups carried over from the previous rollout) and returns a
    :class:`~rlcore.rollout.RolloutOutput`: exactly ``ctx.batch_size`` groups of
    ``ctx.n_samples_per_prompt`` scored samples each, metrics, and any surplus groups to carry
    to the next rollout. The default is :func:`rlcore.rollout.default_rollout` (generate, reward,
    filter, top up). The loop checks the counts and raises
    :class:`~rlcore.errors.RolloutError` naming the function when they are wrong.
    """

    def __call__(self, ctx: RolloutContext, /) -> RolloutOutput: ...


class MetricsSink(Protocol):
    """Receives namespaced metrics (``rollout/...``, ``train/...``, ``eval/...``) at a rollout
    id."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...
