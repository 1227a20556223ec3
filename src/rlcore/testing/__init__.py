"""Typed fakes for tests: stacks, a backend that records what it built, a scripted rollout engine.

They satisfy the protocols structurally, like any backend, so a test that passes with them
exercises the real loop, planner and checkpoint code. The core's own tests use them; users' tests
can too. They import nothing heavy.

:mod:`rlcore.testing.tiny` keeps the names tests use for tiny local models and tokenizers; they
live in :mod:`rlcore.new_model` (``python -m rlcore.new_model``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, final

import attrs

from rlcore.errors import CheckpointError
from rlcore.samples import (
    FinishReason,
    ForwardRows,
    Generation,
    Prompt,
    Sample,
    SamplingParams,
    TrainBatch,
    TrainMetrics,
)
from rlcore.specs import EvalSpec, LRSchedule, ModelSpec, TrainSpec
from rlcore.weights import InProcess, NamedTensors, WeightSink, deliver

__all__ = [
    "FakeBackend",
    "FakeEvalStack",
    "FakeOptimizer",
    "FakeScheduler",
    "FakeTrainingStack",
    "RecordingSink",
    "RecordingWeightSink",
    "ScriptedEngine",
    "label_reward",
]

_STATE_FILE = "fake_stack.json"


@final
class FakeOptimizer:
    """Counts steps; its state is that count."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> Mapping[str, object]:
        return {"steps": self.steps}


@final
class FakeScheduler:
    """Follows the spec's :class:`~rlcore.specs.LRSchedule`."""

    def __init__(self, spec: TrainSpec) -> None:
        self.schedule = spec.optimizer.schedule
        self.steps = 0

    @property
    def lr(self) -> float:
        return self.schedule.lr_at(self.steps)

    def state_dict(self) -> Mapping[str, object]:
        return {"steps": self.steps}


def _load_state(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads((path / _STATE_FILE).read_text())
        return {"rollout_id": int(raw["rollout_id"]), **raw}
    except FileNotFoundError:
        raise CheckpointError(f"no fake-stack checkpoint at {path}") from None
    except (ValueError, AttributeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"corrupt fake-stack checkpoint at {path}: {exc}") from exc


FORWARD_MICRO_BATCH: Final = 16
"""Sequences per forward micro-batch of a fake stack without a token budget (the real
backends' default)."""


def _zeros(samples: Sequence[Sample], spec: ModelSpec, micro_batch: int) -> ForwardRows:
    """Zeros per response token, with the positions a pass would run: in micro-batches of
    ``micro_batch`` samples in order, each padded to its longest sequence; with a token budget
    (``spec.log_probs_max_tokens_per_gpu``) packed, no padding, as packed sequences run (the
    fakes import no torch, so not the core's budget micro-batches)."""
    lengths = [len(s.prompt.token_ids) + len(s.response.token_ids) for s in samples]
    parts = [lengths[i : i + micro_batch] for i in range(0, len(lengths), micro_batch)]
    packed = spec.log_probs_max_tokens_per_gpu is not None
    return ForwardRows(
        (tuple(0.0 for _ in s.response.token_ids) for s in samples),
        sequence_tokens=sum(lengths),
        padded_tokens=sum(lengths) if packed else sum(len(p) * max(p) for p in parts),
    )


@final
class FakeEvalStack:
    """An eval stack: scores are zeros (with the positions a pass would run: :func:`_zeros`),
    weights are a version counter. No optimizer attribute."""

    kind: Final = "eval"

    def __init__(self, spec: EvalSpec) -> None:
        self._spec = spec.model
        self.loaded_from: Path | None = None
        self.forward_micro_batch = FORWARD_MICRO_BATCH

    @property
    def spec(self) -> ModelSpec:
        return self._spec

    def forward(self, samples: Sequence[Sample]) -> ForwardRows:
        return _zeros(samples, self._spec, self.forward_micro_batch)

    def load(self, path: Path) -> int:
        state = _load_state(path)
        self.loaded_from = path
        return int(state["rollout_id"])

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        deliver([], sinks)


@final
class FakeTrainingStack:
    """A training stack that counts ``train_step`` calls and saves/loads them as JSON, with its
    LR schedule: ``load`` restores as the spec's :class:`~rlcore.specs.LoadSpec` says (the
    schedule's values from the checkpoint unless ``scheduler="flags"``, its step count unless
    ``"fresh"``, the optimizer's step count unless ``optimizer=False``), as a real stack does."""

    kind: Final = "train"

    def __init__(self, spec: TrainSpec) -> None:
        self.train_spec = spec
        self._optimizer = FakeOptimizer()
        self._scheduler = FakeScheduler(spec)
        self.batches: list[TrainBatch] = []
        self.saved: list[tuple[Path, int]] = []
        self.exported: list[Path] = []
        self.forward_micro_batch = FORWARD_MICRO_BATCH

    @property
    def spec(self) -> ModelSpec:
        return self.train_spec.model

    @property
    def optimizer(self) -> FakeOptimizer:
        return self._optimizer

    @property
    def scheduler(self) -> FakeScheduler:
        return self._scheduler

    def forward(self, samples: Sequence[Sample]) -> ForwardRows:
        return _zeros(samples, self.spec, self.forward_micro_batch)

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        self.batches.append(batch)
        lr = self._scheduler.lr
        for _ in range(self.train_spec.steps_per_rollout):
            self._optimizer.steps += 1
            self._scheduler.steps += 1
        tokens = sum(len(s.response.token_ids) for s in batch.samples)
        return TrainMetrics(loss=0.0, grad_norm=0.0, lr=lr, tokens=tokens)

    def save(self, path: Path, rollout_id: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        state = {
            "rollout_id": rollout_id,
            "steps": self._optimizer.steps,
            "scheduler_steps": self._scheduler.steps,
            "schedule": attrs.asdict(self._scheduler.schedule),
        }
        (path / _STATE_FILE).write_text(json.dumps(state))
        self.saved.append((path, rollout_id))

    def save_hf(self, folder: Path) -> None:
        """A Hugging Face folder of sorts: ``config.json`` with the optimizer's step count (no
        weights); each folder written is recorded in ``exported``."""
        (folder / "config.json").write_text(json.dumps({"steps": self._optimizer.steps}))
        self.exported.append(folder)

    def load(self, path: Path) -> int:
        state = _load_state(path)
        load = self.train_spec.load
        if load.optimizer:
            self._optimizer.steps = int(state["steps"])
        if load.scheduler != "fresh":
            self._scheduler.steps = int(state.get("scheduler_steps") or state["steps"])
        if load.scheduler == "saved" and "schedule" in state:
            self._scheduler.schedule = LRSchedule(**state["schedule"])
        return int(state["rollout_id"])

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        deliver([], sinks)


@final
class FakeBackend:
    """Builds fake stacks and records every spec it was asked for, in order."""

    def __init__(self) -> None:
        self.training_stacks: list[FakeTrainingStack] = []
        self.eval_stacks: list[FakeEvalStack] = []

    def build_training_stack(self, spec: TrainSpec) -> FakeTrainingStack:
        stack = FakeTrainingStack(spec)
        self.training_stacks.append(stack)
        return stack

    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack:
        stack = FakeEvalStack(spec)
        self.eval_stacks.append(stack)
        return stack

    @property
    def roles_built(self) -> list[str]:
        """``train:actor``, ``eval:reference``, ... in build order."""
        return [f"train:{s.spec.role}" for s in self.training_stacks] + [
            f"eval:{s.spec.role}" for s in self.eval_stacks
        ]


def _alternate(prompt: Prompt, index: int) -> str:
    return prompt.label if index % 2 == 0 else prompt.label + "?"


@final
class ScriptedEngine:
    """A rollout engine whose response text is ``script(prompt, index_in_batch)``.

    Tokens are the characters' code points; log-probs are -1.0 each. The default script answers
    every other sample correctly, so group rewards vary. Records every call and weight update
    (``updates``: the versions; ``received``: the weight names each update got).
    """

    def __init__(self, script: Callable[[Prompt, int], str] = _alternate) -> None:
        self.script = script
        self.calls: list[tuple[int, SamplingParams]] = []
        self.updates: list[int] = []
        self.received: list[tuple[str, ...]] = []
        self._version = 0
        self.closed = False

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        self.calls.append((len(prompts), params))
        out = []
        for i, prompt in enumerate(prompts):
            text = self.script(prompt, i)[: params.max_new_tokens]
            tokens = tuple(ord(ch) for ch in text)
            finish: FinishReason = "length" if len(text) == params.max_new_tokens else "stop"
            out.append(Generation(tokens, tuple(-1.0 for _ in tokens), text, finish, self._version))
        return out

    @contextmanager
    def receive_weights(self, version: int) -> Iterator[list[RecordingWeightSink]]:
        """One in-process sink; the version is recorded only when the update completes."""
        sink = RecordingWeightSink()
        yield [sink]
        self.received.append(sink.names)
        self._version = version
        self.updates.append(version)

    @property
    def interrupts_generation(self) -> bool:
        """A scripted generation is instant, so an interrupting update never finds one in
        flight: it is a plain update (``receive_weights``)."""
        return True

    def receive_weights_interrupting(
        self, version: int
    ) -> contextlib.AbstractContextManager[list[RecordingWeightSink]]:
        return self.receive_weights(version)

    @property
    def weight_version(self) -> int:
        return self._version

    def close(self) -> None:
        self.closed = True


@final
class RecordingWeightSink:
    """An in-process :class:`~rlcore.weights.WeightSink` that keeps the names it received."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()

    @property
    def placement(self) -> InProcess:
        return InProcess()

    def receive(self, weights: NamedTensors) -> None:
        self.names = tuple(name for name, _ in weights)


def label_reward(prompt: Prompt, generation: Generation) -> float:
    """1.0 when the response text equals the prompt's label, else 0.0."""
    return float(generation.text.strip() == prompt.label)


@attrs.define
class RecordingSink:
    """A metrics sink that keeps everything it is given."""

    records: list[tuple[int, dict[str, float]]] = attrs.field(factory=list)
    closed: bool = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.records.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed = True

    def keys(self) -> set[str]:
        return {k for _, m in self.records for k in m}
