"""The loop's side of the protocols: every call into a backend, a stack or a rollout engine goes
through here, so a component that breaks its contract is named in an rlcore error instead of
surfacing as a raw ``ValueError`` three calls later.

- :func:`build_training_stack` / :func:`build_eval_stack` check that what a backend built has
  every method of its protocol and is of the kind asked for (an eval stack that exposes an
  optimizer, a scheduler or a ``train_step`` is a :class:`~rlcore.errors.BackendContractError`:
  an eval-only run cannot build an optimizer even through a backend that is not type-checked),
  and wrap it (:class:`CheckedTrainingStack`, :class:`CheckedEvalStack`), logging how long the
  build took (a start-up stage of a run): an error that is not an
  :class:`~rlcore.errors.RLCoreError` becomes a :class:`~rlcore.errors.BackendError` naming the
  stack and the method, and ``forward`` must return one row per sample and one value per response
  token.
- :class:`CheckedEngine` does the same for a rollout engine (:class:`~rlcore.errors.RolloutError`);
  its ``generate`` is the one place the generation count is checked (:func:`check_generations`).

Errors raised on purpose (``RLCoreError`` subclasses) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final, final

from rlcore.errors import BackendContractError, BackendError, RLCoreError, RolloutError
from rlcore.protocols.engine import (
    RolloutEngine,
    keep_weight_source,
    receive_weights_midway,
    takes_weights_midway,
)
from rlcore.protocols.stacks import (
    Backend,
    EvalStack,
    HFExporter,
    ModelStack,
    Optimizer,
    Scheduler,
    TrainingStack,
)
from rlcore.samples import Generation, Prompt, Sample, SamplingParams, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore.weights import WeightSink, WeightSource

log = logging.getLogger("rlcore")

__all__ = [
    "CheckedEngine",
    "CheckedEvalStack",
    "CheckedHFExporter",
    "CheckedTrainingStack",
    "build_eval_stack",
    "build_training_stack",
    "check_generations",
    "missing_members",
]


def missing_members(obj: object, protocol: type) -> list[str]:
    """The public members of ``protocol`` (and the protocols it extends) that ``obj`` lacks."""
    names = {
        name
        for cls in protocol.__mro__
        if getattr(cls, "_is_protocol", False)
        for name in vars(cls)
        if not name.startswith("_")
    }
    return sorted(name for name in names if not hasattr(obj, name))


def _name(obj: object) -> str:
    return type(obj).__qualname__


@contextlib.contextmanager
def _translated(what: str, error: type[RLCoreError], contract: str) -> Iterator[None]:
    """Re-raise anything but an rlcore error as ``error``, naming ``what`` and its contract."""
    try:
        yield
    except RLCoreError:
        raise
    except Exception as exc:
        raise error(
            f"{what} raised {type(exc).__name__}: {exc}. The {contract} contract is to raise "
            f"rlcore errors ({error.__name__}, ...); fix or wrap the component"
        ) from exc


# --------------------------------------------------------------------------------------------
# Stacks


class _Checked:
    """What both checked stacks share: the wrapped stack, its name, and ``forward``'s checks."""

    def __init__(self, stack: ModelStack, what: str) -> None:
        self._stack = stack
        self._what = what

    @property
    def spec(self) -> ModelSpec:
        return self._stack.spec

    def _call(self, method: str) -> contextlib.AbstractContextManager[None]:
        return _translated(f"{self._what}.{method}", BackendError, "EvalStack/TrainingStack")

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        with self._call("forward"):
            rows = self._stack.forward(samples)
        if len(rows) != len(samples):
            raise BackendError(
                f"{self._what}.forward returned {len(rows)} rows for {len(samples)} samples; "
                "the contract is one row per sample, in order"
            )
        for i, (row, sample) in enumerate(zip(rows, samples, strict=True)):
            if len(row) != len(sample.response.token_ids):
                raise BackendError(
                    f"{self._what}.forward returned {len(row)} values for sample {i}, which has "
                    f"{len(sample.response.token_ids)} response tokens; the contract is one value "
                    "per response token"
                )
        return rows

    def load(self, path: Path) -> int:
        with self._call("load"):
            return self._stack.load(path)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        with self._call("send_weights"):
            self._stack.send_weights(sinks)


@final
class CheckedEvalStack(_Checked):
    """An :class:`~rlcore.protocols.stacks.EvalStack` whose calls are checked (see the module)."""

    kind: Final = "eval"

    def __init__(self, stack: EvalStack, what: str) -> None:
        super().__init__(stack, what)


@final
class CheckedTrainingStack(_Checked):
    """A :class:`~rlcore.protocols.stacks.TrainingStack` whose calls are checked (see the
    module)."""

    kind: Final = "train"

    def __init__(self, stack: TrainingStack, what: str) -> None:
        super().__init__(stack, what)
        self._training = stack

    @property
    def optimizer(self) -> Optimizer:
        return self._training.optimizer

    @property
    def scheduler(self) -> Scheduler:
        return self._training.scheduler

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        with self._call("train_step"):
            return self._training.train_step(batch)

    def save(self, path: Path, rollout_id: int) -> None:
        with self._call("save"):
            self._training.save(path, rollout_id)

    def hf_exporter(self) -> CheckedHFExporter:
        """The stack's Hugging Face export (:class:`~rlcore.protocols.stacks.HFExporter`), checked.
        Raises :class:`~rlcore.errors.BackendContractError` when the stack has none."""
        if not isinstance(self._training, HFExporter):
            raise BackendContractError(
                f"--save-hf writes the actor as a Hugging Face folder, but {self._what} has no "
                "save_hf(folder) method (rlcore.protocols.HFExporter): implement it, or drop "
                "--save-hf"
            )
        return CheckedHFExporter(self._training, self._what)


@final
class CheckedHFExporter:
    """An :class:`~rlcore.protocols.stacks.HFExporter` whose errors are named (see the module)."""

    def __init__(self, stack: HFExporter, what: str) -> None:
        self._stack = stack
        self._what = what

    def save_hf(self, folder: Path) -> None:
        with _translated(f"{self._what}.save_hf", BackendError, "HFExporter"):
            self._stack.save_hf(folder)


def build_training_stack(backend: Backend, spec: TrainSpec) -> CheckedTrainingStack:
    """``backend.build_training_stack(spec)``, checked against the protocol and wrapped."""
    what = f"{_name(backend)}.build_training_stack({spec.model.role})"
    started = _log_building(spec.model, "training")
    with _translated(what, BackendError, "Backend"):
        stack = backend.build_training_stack(spec)
    _log_built(spec.model, "training", started)
    missing = missing_members(stack, TrainingStack)
    if missing:
        raise BackendError(
            f"{what} returned {_a(_name(stack))}, which lacks {', '.join(missing)} of the "
            "TrainingStack protocol (rlcore.protocols); implement them"
        )
    _check_kind(stack, "train", what)
    return CheckedTrainingStack(stack, f"{_name(stack)} ({spec.model.role})")


def build_eval_stack(backend: Backend, spec: EvalSpec) -> CheckedEvalStack:
    """``backend.build_eval_stack(spec)``, checked against the protocol and wrapped."""
    what = f"{_name(backend)}.build_eval_stack({spec.model.role})"
    started = _log_building(spec.model, "eval")
    with _translated(what, BackendError, "Backend"):
        stack = backend.build_eval_stack(spec)
    _log_built(spec.model, "eval", started)
    trains = [name for name in _TRAINING_MEMBERS if hasattr(stack, name)]
    if trains:
        raise BackendContractError(
            f"{what} returned {_a(_name(stack))}, which exposes {', '.join(trains)}: an eval stack "
            f"is a model only (no optimizer, scheduler or train_step), and this run must not "
            f"build an optimizer. Make {_name(backend)}.build_eval_stack return a model-only "
            "stack (kind: Final = 'eval'), not a training stack"
        )
    missing = missing_members(stack, EvalStack)
    if missing:
        raise BackendError(
            f"{what} returned {_a(_name(stack))}, which lacks {', '.join(missing)} of the "
            "EvalStack protocol (rlcore.protocols); implement them"
        )
    _check_kind(stack, "eval", what)
    return CheckedEvalStack(stack, f"{_name(stack)} ({spec.model.role})")


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "a HalfStack", "an EvalStack"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _log_building(model: ModelSpec, kind: str) -> float:
    """Say that a stack is being built (the slowest start-up stage); returns the time."""
    ranks = model.parallel.world_size
    log.info("building the %s's %s stack on %d rank(s)", model.role, kind, ranks)
    return time.monotonic()


def _log_built(model: ModelSpec, kind: str, started: float) -> None:
    log.info("built the %s's %s stack (%.1f s)", model.role, kind, time.monotonic() - started)


_TRAINING_MEMBERS = ("optimizer", "scheduler", "train_step")
"""What an eval stack must not have: with them it would hold (or build) optimizer state."""


def _check_kind(stack: object, kind: str, what: str) -> None:
    actual = getattr(stack, "kind", None)
    if actual != kind:
        raise BackendContractError(
            f"{what} returned {_a(_name(stack))} whose kind is {actual!r}, not {kind!r}; declare "
            f"kind: Final = {kind!r} in its class"
        )


# --------------------------------------------------------------------------------------------
# Rollout engines


def check_generations(
    engine: object, prompts: Sequence[Prompt], generations: Sequence[object]
) -> list[Generation]:
    """``generations`` as a list, after checking the :class:`~rlcore.protocols.engine.RolloutEngine`
    contract: exactly one :class:`~rlcore.samples.Generation` per prompt. Raises
    :class:`~rlcore.errors.RolloutError` naming the engine otherwise."""
    if len(generations) != len(prompts):
        raise RolloutError(
            f"rollout engine {_name(engine)}.generate returned {len(generations)} generations "
            f"for {len(prompts)} prompts; the contract is exactly one per prompt, in order "
            "(a prompt repeated n times is sampled n times)"
        )
    out = []
    for i, generation in enumerate(generations):
        if not isinstance(generation, Generation):
            raise RolloutError(
                f"rollout engine {_name(engine)}.generate returned {_a(_name(generation))} at "
                f"position {i}; the contract is a list of rlcore.Generation"
            )
        out.append(generation)
    return out


@final
class CheckedEngine:
    """A :class:`~rlcore.protocols.engine.RolloutEngine` whose calls are checked (see the
    module)."""

    def __init__(self, engine: RolloutEngine) -> None:
        missing = missing_members(engine, RolloutEngine)
        if missing:
            raise RolloutError(
                f"rollout engine {_name(engine)} lacks {', '.join(missing)} of the RolloutEngine "
                "protocol (rlcore.protocols); implement them"
            )
        self._engine = engine
        self._what = f"rollout engine {_name(engine)}"

    @property
    def engine(self) -> RolloutEngine:
        """The engine being checked."""
        return self._engine

    def _call(self, method: str) -> contextlib.AbstractContextManager[None]:
        return _translated(f"{self._what}.{method}", RolloutError, "RolloutEngine")

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        with self._call("generate"):
            generations = self._engine.generate(prompts, params)
        return check_generations(self._engine, prompts, generations)

    @contextlib.contextmanager
    def receive_weights(self, version: int) -> Iterator[Sequence[WeightSink]]:
        # What the block raises is the sender's (a checked stack raises rlcore errors, which
        # pass through); anything else from here is the engine's.
        with self._call("receive_weights"), self._engine.receive_weights(version) as sinks:
            yield sinks

    @property
    def interrupts_generation(self) -> bool:
        """Whether the checked engine takes weights mid-generation (partial rollouts)."""
        return takes_weights_midway(self._engine)

    @contextlib.contextmanager
    def receive_weights_interrupting(self, version: int) -> Iterator[Sequence[WeightSink]]:
        with (
            self._call("receive_weights_interrupting"),
            receive_weights_midway(self._engine, version) as sinks,
        ):
            yield sinks

    def restore_weights_from(self, source: WeightSource | None) -> None:
        """Passed on when the checked engine restarts servers (a no-op otherwise)."""
        with self._call("restore_weights_from"):
            keep_weight_source(self._engine, source)

    @property
    def weight_version(self) -> int:
        with self._call("weight_version"):
            return self._engine.weight_version

    def close(self) -> None:
        with self._call("close"):
            self._engine.close()
