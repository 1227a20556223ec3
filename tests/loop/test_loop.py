"""The loop with the fake backend: what is built, trained, saved and evaluated, and when."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rlcore.checkpoint_files import find_checkpoint, read_meta
from rlcore.config import RunConfig, structure_config
from rlcore.errors import CheckpointError, ConfigError, PlanError
from rlcore.loop import RunData, run, should_eval, should_save
from rlcore.loop.plan import EvalPlan, TrainPlan, plan
from rlcore.samples import EvalSet, Prompt
from rlcore.testing import FakeBackend, RecordingSink, ScriptedEngine, label_reward
from tests.strategies import valid_config_dicts

PROMPTS = tuple(
    Prompt(
        index=i, text=f"{i}+1=", token_ids=(1, i + 3), label=str(i + 1), target_token_ids=(i + 4, 2)
    )
    for i in range(7)
)
DATA = RunData(train_prompts=PROMPTS, eval_sets=(EvalSet("heldout", PROMPTS[:3]),), seed=3)


def _config(data: dict[str, Any]) -> RunConfig:
    try:
        return structure_config(data)
    except ConfigError:
        assume(False)
        raise


def _with_save(config: RunConfig, folder: Path) -> RunConfig:
    if config.checkpoint.save is None:
        return config
    return attrs.evolve(config, checkpoint=attrs.evolve(config.checkpoint, save=folder))


@given(valid_config_dicts())
def test_fake_run_builds_trains_saves_and_evals_exactly_as_planned(data: dict[str, Any]) -> None:
    config = _config(data)
    with tempfile.TemporaryDirectory() as tmp:
        config = _with_save(config, Path(tmp) / "ckpt")
        the_plan = plan(config)
        backend, engine, sink = FakeBackend(), ScriptedEngine(), RecordingSink()
        if (
            isinstance(the_plan, EvalPlan)
            and the_plan.load is None
            and the_plan.actor.model.hf_checkpoint is None
        ):
            with pytest.raises(PlanError, match="random weights"):
                run(the_plan, backend, engine, label_reward, DATA, sink)
            assert backend.roles_built == []  # refused before anything was built
            the_plan = attrs.evolve(the_plan, random_weights=True)
        result = run(the_plan, backend, engine, label_reward, DATA, sink)

        if isinstance(the_plan, EvalPlan):
            assert backend.training_stacks == []
            assert backend.roles_built == ["eval:actor"] == list(result.built)
            assert result.trained == () and result.saved == ()
            assert set(result.last_eval) >= {"eval/heldout/reward", "eval/heldout/pass@1"}
            return
        assert isinstance(the_plan, TrainPlan)
        n, start = the_plan.num_rollout, the_plan.start_rollout_id or 0
        roles = backend.roles_built
        assert roles.count("train:actor") == 1
        assert roles.count("train:critic") == int(config.algorithm.critic)
        assert roles.count("eval:reference") == int(config.algorithm.uses_kl)
        assert "eval:actor" not in roles
        assert sorted(result.built) == sorted(roles)

        assert result.trained == tuple(range(start, n))
        actor = backend.training_stacks[0]
        assert len(actor.batches) == n - start
        assert actor.optimizer.steps == (n - start) * config.steps_per_rollout
        saving = config.checkpoint.save is not None
        expected_saves = tuple(
            k for k in range(start, n) if should_save(k, n, config.checkpoint.save_interval, saving)
        )
        assert result.saved == expected_saves
        if saving:
            assert result.saved[-1] == n - 1  # the last rollout is always saved
            assert read_meta(find_checkpoint(Path(tmp) / "ckpt")).rollout_id == n - 1
        expected_evals = tuple(
            k for k in range(start, n) if should_eval(k, n, config.eval.interval)
        )
        before = (start - 1,) if the_plan.eval_before_train else ()
        assert result.evaluated == before + expected_evals
        assert engine.updates == [
            start,
            *range(start + 1, n + 1),
        ]  # pushed before and after each rollout


@given(
    st.integers(min_value=0, max_value=50),
    st.integers(min_value=1, max_value=50),
    st.one_of(st.none(), st.integers(min_value=1, max_value=10)),
)
def test_the_last_rollout_is_always_saved_and_evaluated(
    k: int, n: int, interval: int | None
) -> None:
    assume(k < n)
    assert should_save(n - 1, n, interval, saving=True)
    assert not should_save(k, n, interval, saving=False)
    if interval is not None:
        assert should_eval(n - 1, n, interval)
        assert should_eval(k, n, interval) == ((k + 1) % interval == 0 or k == n - 1)
    else:
        assert not should_eval(k, n, interval)


def _train_config(tmp: Path, **overrides: Any) -> RunConfig:
    data: dict[str, Any] = {
        "rollout": {"num_rollout": 4, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "train": {"global_batch_size": 4, "micro_batch_size": 1},
        "checkpoint": {"save": str(tmp / "ckpt"), "save_interval": 2},
        "eval": {"interval": 2, "prompt_data": [{"name": "heldout", "path": "x"}]},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        data.setdefault(section, {})[name] = value
    return structure_config(data)


def test_resume_continues_after_the_saved_rollout_with_the_data_position(tmp_path: Path) -> None:
    first = run(
        plan(_train_config(tmp_path, rollout__num_rollout=2)),
        FakeBackend(),
        ScriptedEngine(),
        label_reward,
        DATA,
    )
    assert first.saved == (1,)
    backend, sink = FakeBackend(), RecordingSink()
    resumed = run(
        plan(_train_config(tmp_path, checkpoint__load=str(tmp_path / "ckpt"))),
        backend,
        ScriptedEngine(),
        label_reward,
        DATA,
        sink,
    )
    assert resumed.trained == (2, 3)
    assert resumed.evaluated[0] == 1  # eval before training happens on a resumed run too
    # The resumed actor saw the prompts an uninterrupted run would have seen at rollouts 2 and 3.
    straight = FakeBackend()
    run(plan(_train_config(tmp_path / "b")), straight, ScriptedEngine(), label_reward, DATA)
    seen = [[s.prompt.index for s in b.samples] for b in backend.training_stacks[0].batches]
    assert seen == [
        [s.prompt.index for s in b.samples] for b in straight.training_stacks[0].batches[2:]
    ]


def test_stacks_that_disagree_on_the_rollout_id_are_a_clear_error(tmp_path: Path) -> None:
    run(
        plan(_train_config(tmp_path, algorithm__use_critic=True)),
        FakeBackend(),
        ScriptedEngine(),
        label_reward,
        DATA,
    )
    folder = find_checkpoint(tmp_path / "ckpt")
    (folder / "critic" / "fake_stack.json").write_text('{"rollout_id": 1, "steps": 2}')
    with pytest.raises(CheckpointError, match="disagree"):
        run(
            plan(
                _train_config(
                    tmp_path,
                    algorithm__use_critic=True,
                    checkpoint__load=str(folder),
                    rollout__num_rollout=6,
                )
            ),
            FakeBackend(),
            ScriptedEngine(),
            label_reward,
            DATA,
        )


def test_missing_checkpoint_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere"):
        run(
            plan(_train_config(tmp_path, checkpoint__load=str(tmp_path / "nowhere"))),
            FakeBackend(),
            ScriptedEngine(),
            label_reward,
            DATA,
        )


def test_eval_only_builds_only_the_actor_eval_stack_and_loads_it(tmp_path: Path) -> None:
    run(
        plan(_train_config(tmp_path, algorithm__use_critic=True, algorithm__use_kl_loss=True)),
        FakeBackend(),
        ScriptedEngine(),
        label_reward,
        DATA,
    )
    config = structure_config(
        {
            "rollout": {"num_rollout": 0},
            "algorithm": {"use_critic": True, "use_kl_loss": True},
            "eval": {"interval": 1, "prompt_data": [{"name": "heldout", "path": "x"}]},
            "checkpoint": {"load": str(tmp_path / "ckpt")},
        }
    )
    backend, engine = FakeBackend(), ScriptedEngine()
    result = run(plan(config), backend, engine, label_reward, DATA)
    assert backend.roles_built == ["eval:actor"]
    assert backend.eval_stacks[0].loaded_from == find_checkpoint(tmp_path / "ckpt") / "actor"
    assert engine.updates == [4]  # the weights after 4 rollouts: version 4, as training pushes
    assert result.evaluated == (3,)  # after rollout id 3
    assert result.last_eval["eval/heldout/reward"] == pytest.approx(
        2 / 3
    )  # the script answers 0 and 2 right


def test_supervised_warm_start_trains_on_targets_without_generating(tmp_path: Path) -> None:
    config = _train_config(
        tmp_path,
        algorithm__sft_warmup_rollouts=2,
        algorithm__use_critic=True,
        eval__interval=None,
        eval__skip_eval_before_train=True,
    )
    backend, engine = FakeBackend(), ScriptedEngine()
    result = run(plan(config), backend, engine, label_reward, DATA)
    assert result.trained == (0, 1, 2, 3)
    actor, critic = backend.training_stacks
    assert [len(b.samples) for b in actor.batches] == [4, 4, 4, 4]
    for batch in actor.batches[:2]:
        assert all(
            s.response.token_ids == s.prompt.target_token_ids and s.reward == 1.0
            for s in batch.samples
        )
        assert all(a == (1.0, 1.0) for a in batch.advantages)
    assert len(critic.batches) == 2  # the critic learns only from sampled rollouts
    assert [n for n, _ in engine.calls] == [4, 4]  # generation only for rollouts 2 and 3


def test_supervised_warm_start_needs_labelled_prompts(tmp_path: Path) -> None:
    unlabelled = RunData(
        train_prompts=tuple(attrs.evolve(p, target_token_ids=()) for p in PROMPTS),
        eval_sets=DATA.eval_sets,
    )
    config = _train_config(tmp_path, algorithm__sft_warmup_rollouts=1, eval__interval=None)
    with pytest.raises(PlanError, match="--sft-warmup-rollouts needs labelled prompts"):
        run(plan(config), FakeBackend(), ScriptedEngine(), label_reward, unlabelled)


def test_a_failed_weight_send_leaves_the_engine_on_its_old_version() -> None:
    from collections.abc import Sequence

    from rlcore.loop import push_weights
    from rlcore.weights import WeightSink

    class Broken:
        def send_weights(self, sinks: Sequence[WeightSink]) -> None:
            raise RuntimeError("the rank died")

    from rlcore.specs import EvalSpec, ModelSpec

    engine = ScriptedEngine()
    push_weights(FakeBackend().build_eval_stack(EvalSpec(ModelSpec("actor", None))), engine, 3)
    assert engine.updates == [3] and engine.received == [()]
    with pytest.raises(RuntimeError, match="the rank died"):
        push_weights(Broken(), engine, version=4)
    assert engine.weight_version == 3 and engine.updates == [3]
