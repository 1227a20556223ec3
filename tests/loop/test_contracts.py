"""Through the Python API: components that break their contract are named in rlcore errors, runs
that would silently do nothing are refused before anything is built, and Ctrl-C reports what the
run had done."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import attrs
import pytest

from rlcore.checkpoint_files import find_checkpoint
from rlcore.config import RunConfig, structure_config
from rlcore.errors import BackendError, CheckpointError, PlanError, RolloutError
from rlcore.loop import RunData, RunInterrupted, run
from rlcore.loop.plan import EvalPlan, plan
from rlcore.loop.records import Progress
from rlcore.samples import EvalSet, ForwardRows, Generation, Prompt, Sample, SamplingParams
from rlcore.specs import EvalSpec, TrainSpec
from rlcore.testing import (
    FakeBackend,
    FakeEvalStack,
    FakeTrainingStack,
    RecordingSink,
    RecordingWeightSink,
    ScriptedEngine,
    label_reward,
)
from rlcore.weights import WeightSink

PROMPTS = tuple(
    Prompt(index=i, text=f"{i}+1=", token_ids=(1, i + 3), label=str(i + 1)) for i in range(6)
)
DATA = RunData(train_prompts=PROMPTS, eval_sets=(EvalSet("heldout", PROMPTS[:2]),), seed=1)


def _config(tmp: Path, **overrides: Any) -> RunConfig:
    data: dict[str, Any] = {
        "rollout": {"num_rollout": 4, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "train": {"global_batch_size": 4, "micro_batch_size": 1},
        "checkpoint": {"save": str(tmp / "ckpt"), "save_interval": 1},
        "eval": {"interval": 2, "prompt_data": [{"name": "heldout", "path": "x"}]},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        data.setdefault(section, {})[name] = value
    return structure_config(data)


class DropsOne:
    """An engine that returns one generation too few."""

    def __init__(self) -> None:
        self.inner = ScriptedEngine()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        return self.inner.generate(prompts, params)[:-1]

    def receive_weights(self, version: int) -> AbstractContextManager[Sequence[WeightSink]]:
        return self.inner.receive_weights(version)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def close(self) -> None:
        pass


class Unreachable:
    """An engine whose server went away: raises what an HTTP client raises."""

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        raise ConnectionError("[Errno 111] Connection refused")

    def receive_weights(self, version: int) -> AbstractContextManager[Sequence[WeightSink]]:
        return contextlib.nullcontext([])

    @property
    def weight_version(self) -> int:
        return 0

    def close(self) -> None:
        pass


class NoWeightSync:
    """An engine without receive_weights."""

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        return []

    @property
    def weight_version(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_an_engine_returning_too_few_generations_is_named(tmp_path: Path) -> None:
    with pytest.raises(RolloutError) as info:
        run(plan(_config(tmp_path)), FakeBackend(), DropsOne(), label_reward, DATA)
    assert str(info.value) == (
        "rollout engine DropsOne.generate returned 1 generations for 2 prompts; the contract is "
        "exactly one per prompt, in order (a prompt repeated n times is sampled n times)"
    )


def test_an_engine_raising_a_foreign_error_becomes_a_rollout_error(tmp_path: Path) -> None:
    with pytest.raises(RolloutError) as info:
        run(plan(_config(tmp_path)), FakeBackend(), Unreachable(), label_reward, DATA)
    assert str(info.value).startswith(
        "rollout engine Unreachable.generate raised ConnectionError: [Errno 111] Connection "
        "refused. The RolloutEngine contract is to raise rlcore errors"
    )
    assert isinstance(info.value.__cause__, ConnectionError)


def test_an_engine_missing_a_method_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    backend = FakeBackend()
    with pytest.raises(
        RolloutError, match="NoWeightSync lacks receive_weights of the RolloutEngine"
    ):
        run(plan(_config(tmp_path)), backend, NoWeightSync(), label_reward, DATA)  # type: ignore[arg-type]
    assert backend.roles_built == []


class HalfStack:
    """A training stack someone forgot to finish: no train_step."""

    def __init__(self, spec: TrainSpec) -> None:
        self.inner = FakeTrainingStack(spec)
        self.spec = spec.model
        self.optimizer = self.inner.optimizer
        self.scheduler = self.inner.scheduler
        self.forward = self.inner.forward
        self.load = self.inner.load
        self.save = self.inner.save
        self.send_weights = self.inner.send_weights


class HalfBackend:
    def build_training_stack(self, spec: TrainSpec) -> HalfStack:
        return HalfStack(spec)

    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack:
        return FakeEvalStack(spec)


class BrokenBackend:
    def build_training_stack(self, spec: TrainSpec) -> FakeTrainingStack:
        raise ValueError("out of memory while allocating the optimizer")

    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack:
        return FakeEvalStack(spec)


class ShortCritic:
    """A backend whose critic's forward loses the last sample."""

    def build_training_stack(self, spec: TrainSpec) -> Any:
        stack = FakeTrainingStack(spec)
        if spec.model.role == "critic":
            original = stack.forward

            def forward(samples: Sequence[Sample]) -> ForwardRows:
                return ForwardRows(original(samples)[:-1])

            stack.forward = forward  # type: ignore[method-assign]
        return stack

    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack:
        return FakeEvalStack(spec)


def test_a_stack_missing_a_protocol_method_is_a_backend_error(tmp_path: Path) -> None:
    with pytest.raises(BackendError) as info:
        run(plan(_config(tmp_path)), HalfBackend(), ScriptedEngine(), label_reward, DATA)  # type: ignore[arg-type]
    assert str(info.value) == (
        "HalfBackend.build_training_stack(actor) returned a HalfStack, which lacks kind, "
        "train_step of the TrainingStack protocol (rlcore.protocols); implement them"
    )


def test_a_backend_raising_a_foreign_error_becomes_a_backend_error(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=r"^BrokenBackend.build_training_stack\(actor\) raised "):
        run(plan(_config(tmp_path)), BrokenBackend(), ScriptedEngine(), label_reward, DATA)


def test_a_forward_with_missing_rows_is_a_backend_error(tmp_path: Path) -> None:
    config = _config(tmp_path, algorithm__use_critic=True)
    with pytest.raises(BackendError, match=r"FakeTrainingStack \(critic\).forward returned 3 rows"):
        run(plan(config), ShortCritic(), ScriptedEngine(), label_reward, DATA)


def test_eval_only_without_weights_is_refused_unless_asked_for(tmp_path: Path) -> None:
    the_plan = plan(
        _config(
            tmp_path, rollout__num_rollout=0, checkpoint__save=None, checkpoint__save_interval=None
        )
    )
    assert isinstance(the_plan, EvalPlan)
    backend = FakeBackend()
    with pytest.raises(PlanError, match="neither a checkpoint .* nor a model folder"):
        run(the_plan, backend, ScriptedEngine(), label_reward, DATA)
    assert backend.roles_built == []
    result = run(
        attrs.evolve(the_plan, random_weights=True), backend, ScriptedEngine(), label_reward, DATA
    )
    assert result.built == ("eval:actor",) and "eval/heldout/reward" in result.last_eval


def test_eval_sets_in_the_config_but_not_in_the_data_are_refused(tmp_path: Path) -> None:
    no_eval = RunData(train_prompts=PROMPTS)
    backend = FakeBackend()
    with pytest.raises(PlanError, match="holds no eval sets, so nothing would be evaluated"):
        run(plan(_config(tmp_path)), backend, ScriptedEngine(), label_reward, no_eval)
    eval_only = plan(
        _config(tmp_path, rollout__num_rollout=0, checkpoint__load=str(tmp_path / "ckpt"))
    )
    with pytest.raises(PlanError, match="holds no eval sets"):
        run(eval_only, backend, ScriptedEngine(), label_reward, no_eval)
    with pytest.raises(PlanError, match="holds no train_prompts"):
        run(
            plan(_config(tmp_path)),
            backend,
            ScriptedEngine(),
            label_reward,
            RunData(eval_sets=DATA.eval_sets),
        )
    assert backend.roles_built == []


def test_load_of_a_checkpoint_at_the_last_rollout_is_refused_before_building(
    tmp_path: Path,
) -> None:
    run(plan(_config(tmp_path)), FakeBackend(), ScriptedEngine(), label_reward, DATA)
    backend = FakeBackend()
    with pytest.raises(PlanError) as info:
        run(
            plan(_config(tmp_path, checkpoint__load=str(tmp_path / "ckpt"))),
            backend,
            ScriptedEngine(),
            label_reward,
            DATA,
        )
    assert str(info.value) == (
        f"--load {tmp_path / 'ckpt'}: the checkpoint rollout_000004 is of rollout 4, so training "
        "would start at rollout 5, but --num-rollout is 4: nothing is left to train. Raise "
        "--num-rollout above 4 to train on, or evaluate the checkpoint with --num-rollout 0 "
        f"--load {tmp_path / 'ckpt'}"
    )
    assert backend.roles_built == []
    with pytest.raises(CheckpointError, match="does not exist"):
        run(
            plan(_config(tmp_path, checkpoint__load=str(tmp_path / "nowhere"))),
            backend,
            ScriptedEngine(),
            label_reward,
            DATA,
        )
    assert backend.roles_built == []


def test_ctrl_c_raises_run_interrupted_with_what_was_done(tmp_path: Path) -> None:
    calls = 0

    def script(prompt: Prompt, index: int) -> str:
        nonlocal calls
        calls += 1
        # Eval before training (2), rollouts 0 and 1 (4 each), eval after rollout 1 (2).
        if calls > 2 + 4 + 4 + 2:
            raise KeyboardInterrupt
        return prompt.label

    sink = RecordingSink()
    with pytest.raises(RunInterrupted) as info:
        run(
            plan(_config(tmp_path)), FakeBackend(), ScriptedEngine(script), label_reward, DATA, sink
        )
    result = info.value.result
    assert result.interrupted and result.interrupted_at == 2
    assert result.trained == (0, 1) and result.saved == (0, 1)
    assert result.built == ("train:actor",)
    assert isinstance(info.value, KeyboardInterrupt)  # `except Exception` does not swallow it
    assert str(info.value) == "interrupted at rollout 3"  # rollout id 2, by its number


class InterruptedSync:
    """Ctrl-C arrives while the weights of rollout 1's update are being received."""

    def __init__(self) -> None:
        self.inner = ScriptedEngine()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        return self.inner.generate(prompts, params)

    @contextlib.contextmanager
    def receive_weights(self, version: int) -> Iterator[list[RecordingWeightSink]]:
        if version == 2:
            raise KeyboardInterrupt
        with self.inner.receive_weights(version) as sinks:
            yield sinks

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def close(self) -> None:
        pass


def test_a_rollout_trained_before_ctrl_c_keeps_its_metrics(tmp_path: Path) -> None:
    sink = RecordingSink()
    with pytest.raises(RunInterrupted) as info:
        run(plan(_config(tmp_path)), FakeBackend(), InterruptedSync(), label_reward, DATA, sink)
    result = info.value.result
    assert result.trained == (0, 1) and result.interrupted_at == 1
    trained_rows = [(step, m) for step, m in sink.records if "train/actor/loss" in m]
    assert [step for step, _ in trained_rows] == [1, 2]  # steps are rollout numbers
    # Rollout 1 saved, then was interrupted in its weight sync: no sync time, no new version.
    assert "perf/save_s" in trained_rows[1][1] and "perf/weight_sync_s" not in trained_rows[1][1]


class StopsAfter(RecordingSink):
    """Asks the run to stop early (as the CLI's SIGTERM handler does) once rollout ``at`` is
    logged."""

    def __init__(self, progress: Progress, at: int) -> None:
        super().__init__()
        self.progress, self.at = progress, at

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        super().log(step, metrics)
        if step == self.at and "train/actor/loss" in metrics:
            self.progress.stop.set()


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_a_stop_request_saves_the_next_rollout_and_stops(
    tmp_path: Path, max_staleness: int
) -> None:
    """Requested while rollout 0 is logged (after its save and sync), the stop is seen once
    rollout 1 is trained: 1 is saved although --save-interval says 10, then the run returns."""
    config = _config(
        tmp_path,
        rollout__num_rollout=6,
        rollout__max_staleness=max_staleness,
        checkpoint__save_interval=10,
    )
    progress = Progress()
    sink = StopsAfter(progress, at=1)  # the first rollout's row
    result = run(
        plan(config), FakeBackend(), ScriptedEngine(), label_reward, DATA, sink, progress=progress
    )
    assert result.stopped and not result.interrupted
    assert result.trained == (0, 1) and result.saved == (1,)
    assert find_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "rollout_000002"
    # Not asked: the run goes to the end, and says it was not stopped.
    finished = run(
        plan(_config(tmp_path / "b")), FakeBackend(), ScriptedEngine(), label_reward, DATA
    )
    assert not finished.stopped and finished.trained == (0, 1, 2, 3)
