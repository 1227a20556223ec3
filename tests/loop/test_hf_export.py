"""The export stage (``--save-hf``) with the fake backend: when it exports, where, what the folder
holds, and what a failed export or a stack that cannot export does. The Megatron stacks' folders
load in transformers with the actor's logits: tests/megatron/test_families.py (every family) and
tests/e2e/test_run.py (through the CLI, fp32 and bf16)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.config import load_config
from rlcore.errors import BackendContractError, CheckpointError, ConfigError
from rlcore.loop import RunData, run
from rlcore.loop.hf_export import TOKENIZER_FILES, hf_folder, should_export_hf
from rlcore.loop.plan import EvalPlan, RolloutOnlyPlan, TrainPlan, plan
from rlcore.protocols.stacks import Backend
from rlcore.samples import Prompt
from rlcore.specs import EvalSpec, TrainSpec
from rlcore.testing import (
    FakeBackend,
    FakeEvalStack,
    FakeTrainingStack,
    ScriptedEngine,
    label_reward,
)

PROMPTS = tuple(Prompt(index=i, text=f"{i}?", token_ids=(1, i + 3), label=str(i)) for i in range(8))
DATA = RunData(train_prompts=PROMPTS, seed=5)
B = TypeVar("B", bound=Backend)


def _flags(rollouts: int, *extra: str) -> list[str]:
    return [
        *("--num-rollout", str(rollouts), "--rollout-batch-size", "2"),
        *("--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "1"),
        *extra,
    ]


def _train_plan(*flags: str) -> TrainPlan:
    the_plan = plan(load_config(list(flags)))
    assert isinstance(the_plan, TrainPlan)
    return the_plan


def _train(the_plan: TrainPlan, backend: B) -> B:
    run(the_plan, backend, ScriptedEngine(), label_reward, DATA)
    return backend


@given(
    st.integers(min_value=1, max_value=30),
    st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
    st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
    st.booleans(),
)
def test_exports_follow_their_interval_or_the_save_interval_and_the_last_rollout(
    n: int, hf_interval: int | None, save_interval: int | None, exporting: bool
) -> None:
    flags = _flags(n)
    if exporting:
        flags += ["--save-hf", "hf"]
        if hf_interval is not None:
            flags += ["--save-hf-interval", str(hf_interval)]
    if save_interval is not None:
        flags += ["--save", "ckpt", "--save-interval", str(save_interval)]
    the_plan = _train_plan(*flags)
    interval = hf_interval or save_interval
    expected = [
        k
        for k in range(n)
        if exporting and (k == n - 1 or (interval is not None and (k + 1) % interval == 0))
    ]
    assert [k for k in range(n) if should_export_hf(the_plan, k)] == expected


def test_a_folder_holds_one_export_per_rollout_and_a_template_names_them() -> None:
    # Named by the rollout's number, the count done: rollout id 12 is the 13th rollout.
    assert hf_folder("out/hf", 12) == Path("out/hf/rollout_000013")
    assert hf_folder("out/iter_{rollout_id}/hf", 12) == Path("out/iter_13/hf")


def test_each_export_holds_the_weights_then_and_the_model_folders_tokenizer(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text('{"tokenizer": 1}')
    (model / "tokenizer_config.json").write_text("{}")
    (model / "model.safetensors").write_text("weights of the start: not carried over")
    the_plan = _train_plan(
        *_flags(5, "--save-hf", str(tmp_path / "hf"), "--save-hf-interval", "2"),
        *("--hf-checkpoint", str(model)),
    )
    backend = _train(the_plan, FakeBackend())
    exports = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert exports == ["rollout_000002", "rollout_000004", "rollout_000005"]  # no debris either
    for name, steps in zip(exports, (2, 4, 5), strict=True):
        folder = tmp_path / "hf" / name
        assert json.loads((folder / "config.json").read_text()) == {"steps": steps}
        assert sorted(p.name for p in folder.iterdir()) == [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
        assert (folder / "tokenizer.json").read_text() == '{"tokenizer": 1}'
    assert len(backend.training_stacks[0].exported) == 3
    assert "tokenizer.json" in TOKENIZER_FILES


def test_the_asynchronous_schedule_exports_too(tmp_path: Path) -> None:
    the_plan = _train_plan(*_flags(4, "--save-hf", str(tmp_path / "hf"), "--max-staleness", "2"))
    _train(the_plan, FakeBackend())
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["rollout_000004"]
    assert json.loads((tmp_path / "hf" / "rollout_000004" / "config.json").read_text()) == {
        "steps": 4
    }


class _NoExport:
    """A training stack without ``save_hf``: a fake one's other members."""

    kind: Final = "train"

    def __init__(self, spec: TrainSpec) -> None:
        self.inner = FakeTrainingStack(spec)
        self.spec = spec.model
        self.optimizer = self.inner.optimizer
        self.scheduler = self.inner.scheduler
        self.forward = self.inner.forward
        self.train_step = self.inner.train_step
        self.load = self.inner.load
        self.save = self.inner.save
        self.send_weights = self.inner.send_weights


class _FailingExport(_NoExport):
    """Exports until its third optimizer step, then fails half-way through writing."""

    def save_hf(self, folder: Path) -> None:
        if self.inner.optimizer.steps > 2:
            (folder / "model.safetensors").write_text("half")
            raise OSError("the disk went away")
        self.inner.save_hf(folder)


class _Backend:
    """Builds training stacks of one class, and fake eval stacks."""

    def __init__(self, stack: type[_NoExport]) -> None:
        self.stack = stack
        self.built: list[_NoExport] = []

    def build_training_stack(self, spec: TrainSpec) -> _NoExport:
        self.built.append(self.stack(spec))
        return self.built[-1]

    def build_eval_stack(self, spec: EvalSpec) -> FakeEvalStack:
        return FakeEvalStack(spec)


def test_a_stack_that_cannot_export_is_refused_before_anything_trains(tmp_path: Path) -> None:
    backend = _Backend(_NoExport)
    with pytest.raises(BackendContractError, match=r"--save-hf .* has no save_hf\(folder\)"):
        _train(_train_plan(*_flags(2, "--save-hf", str(tmp_path / "hf"))), backend)
    assert backend.built[0].inner.batches == []
    assert not (tmp_path / "hf").exists()


def test_a_failed_export_names_its_folder_and_leaves_the_earlier_ones(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    the_plan = _train_plan(*_flags(4, "--save-hf", str(hf), "--save-hf-interval", "2"))
    with pytest.raises(CheckpointError) as info:
        _train(the_plan, _Backend(_FailingExport))
    assert str(info.value) == (
        f"saving the Hugging Face export {hf / 'rollout_000004'} failed: _FailingExport (actor)"
        ".save_hf raised OSError: the disk went away. The HFExporter contract is to raise rlcore "
        "errors (BackendError, ...); fix or wrap the component"
    )
    assert [p.name for p in hf.iterdir()] == ["rollout_000002"]  # no half-written folder
    assert json.loads((hf / "rollout_000002" / "config.json").read_text()) == {"steps": 2}


def test_the_export_flags_are_checked_and_runs_that_train_nothing_say_they_skip_it() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_flags(2, "--save-hf-interval", "0"))
    assert [p.path for p in info.value.problems] == [
        "checkpoint.save_hf_interval (--save-hf-interval)",
        "checkpoint.save_hf_interval (--save-hf-interval)",
    ]
    assert "add --save-hf DIR" in str(info.value)
    eval_only = plan(
        load_config([*_flags(0, "--save-hf", "hf"), "--eval-prompt-data", "heldout", __file__])
    )
    assert isinstance(eval_only, EvalPlan)
    assert "Hugging Face export (--save-hf): an eval-only run trains nothing" in eval_only.skipped
    rollout_only = plan(load_config(_flags(2, "--save-hf", "hf", "--debug-rollout-only")))
    assert isinstance(rollout_only, RolloutOnlyPlan)
    assert "Hugging Face export (--save-hf): nothing is trained" in rollout_only.skipped
