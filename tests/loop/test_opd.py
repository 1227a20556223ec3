"""On-policy distillation through the loop (fake backend): the teacher is built as an eval stack
only when a training run distills, scores every rollout's samples, and its reverse KL moves each
token's advantage; eval-only and rollout-only runs never build it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs
import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError, PlanError, RolloutError
from rlcore.loop import RunData, run
from rlcore.loop.plan import EvalPlan, RolloutOnlyPlan, TrainPlan, plan
from rlcore.protocols.rollout import RewardFn
from rlcore.samples import EvalSet, Generation, Prompt, Sample
from rlcore.specs import EvalSpec, ModelSpec, ServedTeacher, TrainSpec
from rlcore.testing import (
    FakeBackend,
    FakeEvalStack,
    FakeTrainingStack,
    RecordingSink,
    ScriptedEngine,
    label_reward,
)
from rlcore.weights import WeightSink

PROMPTS = tuple(Prompt(index=i, text=f"{i}?", token_ids=(1, i + 3), label=str(i)) for i in range(8))
DATA = RunData(train_prompts=PROMPTS, eval_sets=(EvalSet("heldout", PROMPTS[:2]),), seed=5)
TEACHER_LOGP: Final = -0.75


def _flags(rollouts: int, *extra: str) -> list[str]:
    return [
        *("--num-rollout", str(rollouts), "--rollout-batch-size", "2"),
        *("--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "1"),
        *extra,
    ]


OPD = ("--use-opd", "--opd-teacher-hf-checkpoint", "teacher")


class _Teacher:
    """A teacher that gives every sampled token the log-prob ``TEACHER_LOGP``."""

    kind: Final = "eval"

    def __init__(self, spec: EvalSpec) -> None:
        self.spec: ModelSpec = spec.model
        self.scored = 0
        self.loaded: list[Path] = []

    def forward(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        self.scored += len(samples)
        return [(TEACHER_LOGP,) * len(s.response.token_ids) for s in samples]

    def load(self, path: Path) -> int:
        self.loaded.append(path)
        return FakeEvalStack(EvalSpec(self.spec)).load(path)  # reads the fake checkpoint

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        raise AssertionError("a teacher's weights go nowhere")


class _Backend:
    """Fake training stacks; the teacher is a :class:`_Teacher`, other eval stacks fakes."""

    def __init__(self) -> None:
        self.inner = FakeBackend()
        self.teachers: list[_Teacher] = []

    def build_training_stack(self, spec: TrainSpec) -> FakeTrainingStack:
        return self.inner.build_training_stack(spec)

    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack | _Teacher:
        if spec.model.role == "teacher":
            self.teachers.append(_Teacher(spec))
            return self.teachers[-1]
        return self.inner.build_eval_stack(spec)


class _ServedTeacher:
    """A teacher server (``--opd-type sglang``) that gives every sampled token the log-prob
    ``TEACHER_LOGP``, and records the rollout batches it scored."""

    def __init__(self) -> None:
        self.scored = 0
        self.calls: list[tuple[int, ...]] = []
        self.temperatures: list[float] = []

    def score(self, samples: Sequence[Sample], temperature: float) -> list[tuple[float, ...]]:
        self.scored += len(samples)
        self.calls.append(tuple(s.prompt.index for s in samples))
        self.temperatures.append(temperature)
        return [(TEACHER_LOGP,) * len(s.response.token_ids) for s in samples]


SERVED = ("--use-opd", "--opd-type", "sglang", "--opd-teacher-url", "http://teacher:30000/")


def _train(
    *flags: str, reward_fn: RewardFn = label_reward, teacher: _ServedTeacher | None = None
) -> tuple[_Backend, RecordingSink]:
    the_plan = plan(load_config(list(flags)))
    assert isinstance(the_plan, TrainPlan)
    backend, sink = _Backend(), RecordingSink()
    result = run(the_plan, backend, ScriptedEngine(), reward_fn, DATA, sink, teacher=teacher)
    built = the_plan.opd is not None and isinstance(the_plan.opd.teacher, EvalSpec)
    assert ("eval:teacher" in result.built) == built
    return backend, sink


@pytest.mark.parametrize("served", [False, True], ids=["megatron", "sglang"])
@pytest.mark.parametrize("schedule", [(), ("--max-staleness", "1")], ids=["sync", "one-off"])
def test_the_teacher_moves_each_tokens_advantage_by_its_reverse_kl(
    schedule: tuple[str, ...], served: bool
) -> None:
    """Either teacher: an eval stack the backend builds (scoring at train time), or a server
    that scores each rollout as it is made, which the backend never builds."""
    base, _ = _train(*_flags(3, *schedule))
    coef = 0.5
    server = _ServedTeacher() if served else None
    flags = _flags(3, *schedule, *(SERVED if served else OPD), "--opd-kl-coef", str(coef))
    distilled, sink = _train(*flags, teacher=server)
    if server is not None:
        assert distilled.teachers == [] and len(server.calls) == 3  # once per rollout, whole
        teacher: _ServedTeacher | _Teacher = server
    else:
        (teacher,) = distilled.teachers
    assert teacher.scored == 3 * 4  # every sample of every rollout, once
    before = base.inner.training_stacks[0].batches
    after = distilled.inner.training_stacks[0].batches
    assert len(before) == len(after) == 3
    for b, a in zip(before, after, strict=True):
        assert [s.response for s in b.samples] == [s.response for s in a.samples]
        # The fake actor's log-probs are 0: each token's reverse KL estimate is 0 - TEACHER_LOGP.
        for base_row, row in zip(b.advantages, a.advantages, strict=True):
            assert row == tuple(x - coef * (0.0 - TEACHER_LOGP) for x in base_row)
    rows = [m for _, m in sink.records if "opd/kl_mean" in m]
    assert len(rows) == 3
    assert all(math.isclose(m["opd/kl_mean"], -TEACHER_LOGP) for m in rows)
    assert all(
        m["opd/teacher_logprob_mean"] == TEACHER_LOGP and m["perf/teacher_s"] >= 0 for m in rows
    )


def test_with_normalize_advantages_the_teachers_term_is_whitened_with_the_rest() -> None:
    """slime's order: the estimator, plus the teacher's term, then --normalize-advantages. The
    fake actor's log-probs are 0, so the term is the same on every token: whitened with the
    rest it vanishes, where whitening first and adding after would shift every advantage."""
    whiten = ("--normalize-advantages",)
    base, _ = _train(*_flags(2, *whiten))
    distilled, _ = _train(*_flags(2, *whiten, *OPD, "--opd-kl-coef", "0.5"))
    before = base.inner.training_stacks[0].batches
    after = distilled.inner.training_stacks[0].batches
    for b, a in zip(before, after, strict=True):
        assert [s.response for s in b.samples] == [s.response for s in a.samples]
        flat = [x for row in a.advantages for x in row]
        assert flat == pytest.approx([x for row in b.advantages for x in row], abs=1e-9)
        assert math.fsum(flat) == pytest.approx(0.0, abs=1e-9)


def test_the_built_teacher_is_named_for_its_kind_and_slimes_name_still_works() -> None:
    """``--opd-type backend`` (the default) is a teacher the training backend builds, whichever
    backend; ``megatron``, slime's name for it, plans the same teacher."""
    plans = [plan(load_config(_flags(2, *OPD, *kind))) for kind in ((), ("--opd-type", "megatron"))]
    teachers = [p.opd.teacher for p in plans if isinstance(p, TrainPlan) and p.opd is not None]
    assert len(teachers) == 2 and teachers[0] == teachers[1]
    assert isinstance(teachers[0], EvalSpec) and teachers[0].model.role == "teacher"


def test_a_served_teacher_is_a_url_and_a_run_needs_its_server() -> None:
    the_plan = plan(load_config(_flags(2, *SERVED)))
    assert isinstance(the_plan, TrainPlan) and the_plan.opd is not None
    assert the_plan.opd.teacher == ServedTeacher("http://teacher:30000")
    with pytest.raises(PlanError, match=r"distills from the teacher served at http://teacher"):
        run(the_plan, _Backend(), ScriptedEngine(), label_reward, DATA)


def test_a_served_teacher_that_scores_the_wrong_tokens_is_named() -> None:
    class Short(_ServedTeacher):
        def score(self, samples: Sequence[Sample], temperature: float) -> list[tuple[float, ...]]:
            return [row[1:] for row in super().score(samples, temperature)]

    with pytest.raises(
        RolloutError, match=r"teacher server Short gave sample 0 0 log-probs for 1 response"
    ):
        _train(*_flags(2, *SERVED), teacher=Short())


@pytest.mark.parametrize("schedule", [(), ("--max-staleness", "1")], ids=["sync", "one-off"])
def test_both_teachers_score_at_the_rollout_temperature(schedule: tuple[str, ...]) -> None:
    """The student's log-probs are of ``logits / T`` at the rollout's temperature, so are the
    teacher's: a served teacher is asked at that temperature, a built one is specified with it."""
    hot = ("--rollout-temperature", "0.7")
    server = _ServedTeacher()
    _train(*_flags(2, *schedule, *SERVED, *hot), teacher=server)
    assert server.temperatures == [0.7, 0.7]
    built, _ = _train(*_flags(2, *schedule, *OPD, *hot))
    (teacher,) = built.teachers
    assert teacher.spec.temperature == 0.7


def test_runs_that_train_nothing_build_no_teacher_and_say_so() -> None:
    eval_only = plan(load_config([*_flags(0, *OPD), "--eval-prompt-data", "heldout", __file__]))
    assert isinstance(eval_only, EvalPlan)
    assert "teacher (--use-opd): an eval-only run distills nothing" in eval_only.skipped
    rollout_only = plan(load_config(_flags(2, *OPD, "--debug-rollout-only")))
    assert isinstance(rollout_only, RolloutOnlyPlan)
    assert "teacher (--use-opd): nothing is trained" in rollout_only.skipped
    backend = _Backend()
    run(attrs.evolve(eval_only, random_weights=True), backend, ScriptedEngine(), label_reward, DATA)
    assert backend.teachers == []


def test_the_opd_flags_are_checked() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_flags(2, "--use-opd"))
    assert "add --opd-teacher-hf-checkpoint DIR" in str(info.value)
    assert "or --opd-teacher-load DIR (an rlcore checkpoint)" in str(info.value)
    with pytest.raises(ConfigError, match=r"opd.opd_teacher_load \(--opd-teacher-load\): names"):
        load_config(_flags(2, *OPD, "--opd-teacher-load", "ckpt"))
    with pytest.raises(ConfigError, match=r"--opd-teacher-ckpt-step\): picks a checkpoint of"):
        load_config(_flags(2, *OPD, "--opd-teacher-ckpt-step", "3"))
    counted = r"--opd-teacher-ckpt-step\): must be >= 1 \(rollouts are counted from 1\), got -1"
    with pytest.raises(ConfigError, match=counted):
        load_config(_flags(2, "--use-opd", "--opd-teacher-load", "c", "--opd-teacher-ckpt-step=-1"))
    with pytest.raises(ConfigError, match=r"opd.opd_only \(--opd-only\): has no effect without"):
        load_config(_flags(2, "--opd-only"))
    with pytest.raises(ConfigError, match=r"opd.opd_kl_coef \(--opd-kl-coef\): has no effect"):
        load_config(_flags(2, "--opd-kl-coef", "0.1"))
    with pytest.raises(ConfigError, match=r"--opd-kl-coef\): must be >= 0"):
        load_config(_flags(2, *OPD, "--opd-kl-coef", "-1"))


def test_the_served_teacher_flags_are_checked() -> None:
    sglang = ("--use-opd", "--opd-type", "sglang")
    with pytest.raises(ConfigError) as info:
        load_config(_flags(2, *sglang))
    assert "opd.opd_teacher_url (--opd-teacher-url): --opd-type sglang needs the teacher's" in str(
        info.value
    )
    assert "python -m sglang.launch_server --model-path" in str(info.value)
    with pytest.raises(ConfigError, match=r"must be an http:// or https:// URL, got 'teacher:1'"):
        load_config(_flags(2, *sglang, "--opd-teacher-url", "teacher:1"))
    with pytest.raises(ConfigError, match=r"--opd-teacher-url\): names a teacher server, but"):
        load_config(_flags(2, *OPD, "--opd-teacher-url", "http://t:1"))
    for flag, value in [
        ("--opd-teacher-hf-checkpoint", "teacher"),
        ("--opd-teacher-load", "ckpt"),
        ("--opd-teacher-ckpt-step", "3"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(_flags(2, *SERVED, flag, value))
        assert f"({flag}): names the teacher's weights, but with --opd-type sglang" in str(
            info.value
        )
        assert len(info.value.problems) == 1, info.value
    with pytest.raises(ConfigError, match=r"--opd-teacher-url\): has no effect without --use"):
        load_config(_flags(2, "--opd-teacher-url", "http://t:1"))


def _teacher_checkpoints(tmp_path: Path) -> Path:
    """A save folder written by a (fake-backend) training run of the model folder ``teacher``:
    checkpoints of rollouts 1 and 2, recording that folder."""
    save = tmp_path / "teacher_run"
    flags = ["--hf-checkpoint", str(tmp_path / "teacher"), "--save", str(save)]
    _train(*_flags(2, *flags, "--save-interval", "1"))
    return save


@pytest.mark.parametrize("step", [None, 1], ids=["latest", "step-1"])
def test_a_teacher_from_a_checkpoint_is_its_runs_model_with_the_checkpoints_weights(
    tmp_path: Path, step: int | None
) -> None:
    save = _teacher_checkpoints(tmp_path)
    picked = ("--opd-teacher-ckpt-step", str(step)) if step is not None else ()
    flags = _flags(2, "--use-opd", "--opd-teacher-load", str(save), *picked)
    the_plan = plan(load_config(flags))
    assert isinstance(the_plan, TrainPlan) and the_plan.opd is not None
    checkpoint = save / f"rollout_00000{2 if step is None else step}"
    assert the_plan.opd.teacher_load == checkpoint
    # The architecture is the model folder the checkpoint's run recorded, as --load's.
    assert isinstance(the_plan.opd.teacher, EvalSpec)
    assert the_plan.opd.teacher.model.hf_checkpoint == tmp_path / "teacher"
    assert the_plan.opd.teacher.model.role == "teacher"
    distilled, sink = _train(*flags)
    (teacher,) = distilled.teachers
    assert teacher.loaded == [checkpoint / "actor"]
    assert len([m for _, m in sink.records if "opd/kl_mean" in m]) == 2


def test_a_teacher_checkpoint_step_that_is_not_there_names_those_that_are(tmp_path: Path) -> None:
    save = _teacher_checkpoints(tmp_path)
    flags = _flags(2, "--use-opd", "--opd-teacher-load", str(save), "--opd-teacher-ckpt-step", "7")
    with pytest.raises(ConfigError) as info:
        plan(load_config(flags))
    assert (
        f"opd.opd_teacher_load (--opd-teacher-load): {save} has no checkpoint of rollout 7: it "
        "holds checkpoints of rollouts 1, 2"
    ) in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        plan(load_config(_flags(2, "--use-opd", "--opd-teacher-load", str(tmp_path / "none"))))


def _no_reward_here(prompt: Prompt, generation: Generation) -> float:
    raise AssertionError("--opd-only scores nothing")


@pytest.mark.parametrize("schedule", [(), ("--max-staleness", "1")], ids=["sync", "one-off"])
def test_pure_distillation_is_the_teachers_reverse_kl_alone_without_any_reward(
    schedule: tuple[str, ...],
) -> None:
    coef = 0.5
    flags = _flags(3, *schedule, *OPD, "--opd-only", "--opd-kl-coef", str(coef))
    distilled, sink = _train(*flags, reward_fn=_no_reward_here)
    (teacher,) = distilled.teachers
    assert teacher.scored == 3 * 4
    batches = distilled.inner.training_stacks[0].batches
    assert len(batches) == 3
    for batch in batches:
        assert all(s.reward == 0.0 for s in batch.samples)
        # The fake actor's log-probs are 0: each token's advantage is -coef * (0 - TEACHER_LOGP).
        for sample, row in zip(batch.samples, batch.advantages, strict=True):
            assert row == (-coef * (0.0 - TEACHER_LOGP),) * len(sample.response.token_ids)
    rows = [m for _, m in sink.records if "opd/kl_mean" in m]
    assert len(rows) == 3 and all("rollout/kl_penalty" not in m for m in rows)


def test_pure_distillation_refuses_the_reward_filter_before_building_anything() -> None:
    """The built-in dynamic-sampling filter keeps groups whose rewards differ; with --opd-only
    every reward is 0, so it would keep none, after --max-rounds rounds of generation."""
    reward_filter = ("--dynamic-sampling-filter-path", "rlcore.rollout:check_reward_nonzero_std")
    with pytest.raises(PlanError, match=r"with --opd-only no sample is scored \(every reward"):
        _train(*_flags(2, *OPD, "--opd-only", *reward_filter), reward_fn=_no_reward_here)
    distilled, _ = _train(*_flags(2, *OPD, *reward_filter))  # with a reward it is the user's call
    assert len(distilled.inner.training_stacks[0].batches) == 2


def test_pure_distillation_refuses_what_learns_from_a_reward() -> None:
    only = (*OPD, "--opd-only")
    for extra, flag in [
        (("--advantage-estimator", "ppo"), "--advantage-estimator ppo"),
        (("--use-critic",), "--use-critic"),
        (("--use-kl-loss", "--kl-coef", "0.1"), "--kl-coef"),
        (("--normalize-advantages",), "--normalize-advantages"),
        (("--sft-warmup-rollouts", "1"), "--sft-warmup-rollouts"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_config(_flags(2, *only, *extra))
        assert f"{flag} does not go with --opd-only" in str(info.value), extra
    with pytest.raises(ConfigError, match="with --opd-kl-coef 0 every advantage is 0"):
        load_config(_flags(2, *only, "--opd-kl-coef", "0"))
