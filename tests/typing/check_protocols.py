"""Read only by mypy (``nox -s typecheck``, with warn_unused_ignores).

Each ``# type: ignore[code]`` below marks a line that *must not* type-check: the day it starts to
type-check, the ignore becomes unused and the type check fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, assert_never, assert_type

from rlcore import (
    EvalPlan,
    Plan,
    RolloutContext,
    RolloutOnlyPlan,
    RolloutOutput,
    Sample,
    TrainPlan,
)
from rlcore.backend_api import EvalSpec, EvalStack, TrainingStack, TrainSpec
from rlcore.loop.stages import TrainStacks
from rlcore.protocols.engine import RolloutEngine, TeacherServer
from rlcore.protocols.rollout import GroupFilter, RewardFn, RolloutFn
from rlcore.protocols.stacks import Backend, ModelStack
from rlcore.rollout import check_reward_nonzero_std, default_rollout
from rlcore.rollout.rewards import AsyncRewardFn
from rlcore.samples import ForwardRows, Generation, Prompt, SamplingParams
from rlcore.specs import ServedTeacher
from rlcore.testing import (
    FakeBackend,
    FakeEvalStack,
    FakeTrainingStack,
    RecordingWeightSink,
    ScriptedEngine,
)
from rlcore.weights import AnyProcess, InProcess, NamedTensors, OnHost, WeightSink, WeightSource


def eval_stack_has_no_optimizer(stack: EvalStack) -> None:
    _ = stack.optimizer  # type: ignore[attr-defined]
    _ = stack.scheduler  # type: ignore[attr-defined]
    _ = stack.train_step  # type: ignore[attr-defined]


def training_stack_has_them(stack: TrainingStack) -> None:
    stack.optimizer.state_dict()
    stack.scheduler.state_dict()


class BackendThatCheats:
    """A backend whose ``build_eval_stack`` hands out a training stack. A training stack is not
    an eval stack (their ``kind`` tags differ), so neither the method nor the class as a
    :class:`Backend` type-checks: an eval-only run cannot be given an optimizer this way."""

    def __init__(self, stack: FakeTrainingStack) -> None:
        self.stack = stack

    def build_training_stack(self, spec: TrainSpec) -> TrainingStack:
        return self.stack

    def build_eval_stack(self, spec: EvalSpec) -> FakeTrainingStack:
        return self.stack


def cheating_backend_is_not_a_backend(stack: FakeTrainingStack) -> Backend:
    return BackendThatCheats(stack)  # type: ignore[return-value]


def eval_stack_from_a_training_stack(stack: FakeTrainingStack) -> EvalStack:
    return stack  # type: ignore[return-value]


def a_training_stack_is_not_an_eval_stack(stack: TrainingStack) -> EvalStack:
    return stack  # type: ignore[return-value]


def both_are_model_stacks(e: EvalStack, t: TrainingStack) -> tuple[ModelStack, ModelStack]:
    assert_type(e.kind, Literal["eval"])
    assert_type(t.kind, Literal["train"])
    return e, t


def eval_plan_has_no_training_parts(p: EvalPlan) -> None:
    _ = p.critic  # type: ignore[attr-defined]
    _ = p.reference  # type: ignore[attr-defined]
    _ = p.actor.optimizer  # type: ignore[attr-defined]


def rollout_only_plan_has_no_training_parts(p: RolloutOnlyPlan, backend: Backend) -> None:
    """--debug-rollout-only: no optimizer, critic, reference or training spec anywhere."""
    _ = p.critic  # type: ignore[attr-defined]
    _ = p.reference  # type: ignore[attr-defined]
    _ = p.advantage  # type: ignore[attr-defined]
    _ = p.actor.optimizer  # type: ignore[attr-defined]
    backend.build_training_stack(p.actor)  # type: ignore[arg-type]
    assert_type(backend.build_eval_stack(p.actor), EvalStack)


def train_plan_critic_is_optional(p: TrainPlan) -> None:
    assert_type(p.critic, TrainSpec | None)
    assert_type(p.reference, EvalSpec | None)


def a_teacher_is_an_eval_stack(stacks: TrainStacks, p: TrainPlan, backend: Backend) -> None:
    """On-policy distillation's teacher has no optimizer, scheduler or training step, by type."""
    if stacks.teacher is not None:
        _ = stacks.teacher.optimizer  # type: ignore[attr-defined]
        _ = stacks.teacher.train_step  # type: ignore[attr-defined]
    if p.opd is not None:
        assert_type(p.opd.teacher, EvalSpec | ServedTeacher)
        backend.build_training_stack(p.opd.teacher)  # type: ignore[arg-type]
        if isinstance(p.opd.teacher, ServedTeacher):
            # A served teacher is a URL: nothing to build a stack from, of either kind.
            backend.build_eval_stack(p.opd.teacher)  # type: ignore[arg-type]


def a_served_teacher_only_scores(teacher: TeacherServer) -> None:
    """The teacher server's one capability is scoring; it cannot be trained, loaded or synced."""
    _ = teacher.score
    _ = teacher.train_step  # type: ignore[attr-defined]
    _ = teacher.load  # type: ignore[attr-defined]
    _ = teacher.send_weights  # type: ignore[attr-defined]


def match_is_exhaustive(p: Plan) -> str:
    match p:
        case EvalPlan():
            return "eval"
        case TrainPlan():
            return "train"
        case RolloutOnlyPlan():
            return "rollout"
        case _:
            assert_never(p)


def match_missing_a_case_is_an_error(p: Plan) -> str:
    match p:
        case EvalPlan():
            return "eval"
        case TrainPlan():
            return "train"
        case _:
            assert_never(p)  # type: ignore[arg-type]


def my_rollout(ctx: RolloutContext) -> RolloutOutput:
    """A user's rollout function: the default one, then something of their own."""
    return default_rollout(ctx)


def not_a_rollout(ctx: RolloutContext, extra: int) -> RolloutOutput:
    return default_rollout(ctx)


def wrong_result(ctx: RolloutContext) -> list[Sample]:
    return []


rollout_ok: RolloutFn = my_rollout
default_ok: RolloutFn = default_rollout
extra_argument: RolloutFn = not_a_rollout  # type: ignore[assignment]
wrong_return_type: RolloutFn = wrong_result  # type: ignore[assignment]


def first_reward_positive(group: Sequence[Sample]) -> bool:
    return group[0].reward > 0


filter_ok: GroupFilter = first_reward_positive
builtin_filter_ok: GroupFilter = check_reward_nonzero_std


class MyBackend:
    """A user-written backend: two methods, no base class."""

    def build_training_stack(self, spec: TrainSpec) -> FakeTrainingStack:
        return FakeTrainingStack(spec)

    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack:
        return FakeEvalStack(spec)


class NotABackend:
    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack:
        return FakeEvalStack(spec)


class WrongReturnBackend:
    """Returns an eval stack where a training stack is required."""

    def build_training_stack(self, spec: TrainSpec) -> FakeEvalStack:
        return FakeEvalStack(EvalSpec(spec.model))

    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack:
        return FakeEvalStack(spec)


backend_ok: Backend = MyBackend()
fake_ok: Backend = FakeBackend()
missing_method: Backend = NotABackend()  # type: ignore[assignment]
wrong_return: Backend = WrongReturnBackend()  # type: ignore[assignment]


def an_eval_stack_is_not_a_training_stack(stack: FakeEvalStack) -> TrainingStack:
    return stack  # type: ignore[return-value]


def short_names(p: Prompt, g: Generation) -> float:
    return float(g.text == p.label)


async def short_names_async(p: Prompt, g: Generation) -> float:
    return float(g.text == p.label)


def takes_one(p: Prompt) -> float:
    return 0.0


def reward_parameters_are_positional_only() -> None:
    fits: RewardFn = short_names  # any names: the protocol's parameters are positional-only
    fits_async: AsyncRewardFn = short_names_async
    too_few: RewardFn = takes_one  # type: ignore[assignment]
    del fits, fits_async, too_few


# -- the weight seam ----------------------------------------------------------------------------


def engines_and_stacks_meet_through_sinks(
    engine: RolloutEngine, stack: EvalStack, source: WeightSource
) -> None:
    with engine.receive_weights(3) as sinks:
        assert_type(sinks, Sequence[WeightSink])
        stack.send_weights(sinks)
        source.send_weights(sinks)
        for sink in sinks:
            assert_type(sink.placement, InProcess | AnyProcess | OnHost)


def an_engine_takes_no_weights_from_the_caller(engine: RolloutEngine) -> None:
    engine.update_weights([], 1)  # type: ignore[attr-defined]


def a_forward_may_say_the_positions_it_ran(
    stack: ModelStack, fake: FakeEvalStack, samples: Sequence[Sample]
) -> None:
    """``forward`` gives a list; a ``ForwardRows`` (the core's scoring's, the fakes') is one
    that says the positions it ran, for the padding metric, and a plain list, which says
    nothing, is a whole answer too (an own stack keeps working)."""
    rows = stack.forward(samples)
    assert_type(rows, list[tuple[float, ...]])
    _ = rows.padded_tokens  # type: ignore[attr-defined]
    if isinstance(rows, ForwardRows):
        assert_type(rows.padded_tokens, int)
    assert_type(fake.forward(samples), ForwardRows)


def a_stack_has_no_driver_side_export(stack: EvalStack) -> None:
    stack.export_weights()  # type: ignore[attr-defined]


scripted_ok: RolloutEngine = ScriptedEngine()
sink_ok: WeightSink = RecordingWeightSink()


class HalfAnEngine:
    """Generates but cannot take weights."""

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        return []

    @property
    def weight_version(self) -> int:
        return 0

    def close(self) -> None:
        pass


not_an_engine: RolloutEngine = HalfAnEngine()  # type: ignore[assignment]


class SinkWithoutPlacement:
    def receive(self, weights: NamedTensors) -> None:
        pass


not_a_sink: WeightSink = SinkWithoutPlacement()  # type: ignore[assignment]
