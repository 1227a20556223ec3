"""The off-policy schedule (``--max-staleness``) with the fake backend and a scripted engine: the
staleness bound holds whatever the timing, every generated group is trained, dropped (counted) or
carried across a save, K = 0 and K = 1 are deterministic and K = 0 is the synchronous schedule."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlcore.config import RunConfig, structure_config
from rlcore.loop import RunData, run
from rlcore.loop.overlap import run_overlapped_training
from rlcore.loop.plan import TrainPlan, plan
from rlcore.loop.records import Progress
from rlcore.loop.training import run_training
from rlcore.samples import EvalSet, Generation, Prompt, SamplingParams
from rlcore.testing import FakeBackend, RecordingSink, ScriptedEngine, label_reward
from rlcore.weights import WeightSink, WeightSource

PROMPTS = tuple(
    Prompt(index=i, text=f"{i}?", token_ids=(1, i + 3), label=str(i), target_token_ids=(i + 4, 2))
    for i in range(11)
)
DATA = RunData(train_prompts=PROMPTS, eval_sets=(EvalSet("held", PROMPTS[:3]),), seed=5)
TIMING = ("perf/", "rollout/staleness", "rollout/stale_dropped", "rollout/weights_deferred")


def every_third_always_right(prompt: Prompt, i: int) -> str:
    """Prompts 0, 3, 6, 9: rewards all 1 (filtered out by dynamic sampling); others alternate."""
    return prompt.label if prompt.index % 3 == 0 or i % 2 == 0 else "x"


def _config(tmp: Path, **sections: dict[str, Any]) -> RunConfig:
    data: dict[str, Any] = {
        "rollout": {"num_rollout": 6, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "train": {"global_batch_size": 4, "micro_batch_size": 1},
        "checkpoint": {"save": str(tmp / "ckpt"), "save_interval": 2},
        "eval": {"interval": 2, "prompt_data": [{"name": "held", "path": "x"}]},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return structure_config(data)


def _train(
    config: RunConfig, engine: ScriptedEngine | None = None
) -> tuple[FakeBackend, RecordingSink]:
    backend, sink = FakeBackend(), RecordingSink()
    run(plan(config), backend, engine or ScriptedEngine(), label_reward, DATA, sink)
    return backend, sink


def _seen(backend: FakeBackend) -> list[list[tuple[int, str, int, int]]]:
    """What each training step saw: prompt, text, first- and last-token weight versions."""
    return [
        [
            (
                s.prompt.index,
                s.response.text,
                s.response.first_weight_version,
                s.response.weight_version,
            )
            for s in batch.samples
        ]
        for batch in backend.training_stacks[0].batches
    ]


def _rows(sink: RecordingSink) -> list[tuple[int, dict[str, float]]]:
    """The logged metrics without timings (and without the off-policy schedule's own keys)."""
    return [
        (step, {k: v for k, v in m.items() if not k.startswith(TIMING)}) for step, m in sink.records
    ]


def test_one_step_off_policy_trains_rollout_j_on_weights_j_minus_1(tmp_path: Path) -> None:
    backend, sink = _train(_config(tmp_path, rollout={"max_staleness": 1}))
    seen = _seen(backend)
    assert len(seen) == 6
    # Rollout 0 is generated with the start's weights; rollout j > 0 with version j - 1.
    assert {(f, w) for _, _, f, w in seen[0]} == {(0, 0)}
    for j in range(1, 6):
        assert {(f, w) for _, _, f, w in seen[j]} == {(j - 1, j - 1)}
    rows = [m for _, m in sink.records if "rollout/staleness_max" in m]
    assert [m["rollout/staleness_max"] for m in rows] == [0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert all(m["perf/trainer_idle_s"] >= 0 and m["perf/engine_idle_s"] >= 0 for m in rows)
    # The off-policy correction is on: every step reweighted tokens by trainer/engine ratios.
    the_plan = plan(_config(tmp_path, rollout={"max_staleness": 1}))
    assert isinstance(the_plan, TrainPlan) and the_plan.actor.loss.correction is not None


def test_one_step_off_policy_is_deterministic(tmp_path: Path) -> None:
    config = _config(tmp_path / "a", rollout={"max_staleness": 1})
    first, first_sink = _train(config)
    second, second_sink = _train(
        attrs.evolve(config, checkpoint=attrs.evolve(config.checkpoint, save=tmp_path / "b"))
    )
    assert _seen(first) == _seen(second)
    assert _rows(first_sink) == _rows(second_sink)


def _direct(config: RunConfig, max_staleness: int) -> tuple[FakeBackend, RecordingSink]:
    """The off-policy schedule called directly (``run`` takes the synchronous one for K = 0)."""
    the_plan = plan(config)
    assert isinstance(the_plan, TrainPlan)
    backend, sink = FakeBackend(), RecordingSink()
    run_overlapped_training(
        attrs.evolve(the_plan, max_staleness=max_staleness),
        backend,
        ScriptedEngine(every_third_always_right),
        label_reward,
        DATA,
        sink,
        Progress(),
    )
    return backend, sink


def test_k0_in_the_off_policy_schedule_is_the_synchronous_schedule(tmp_path: Path) -> None:
    # Dynamic sampling drops the surplus here: a kept surplus group is one rollout old when it
    # is trained on, which the synchronous schedule allows and a bound of 0 does not.
    sections = {
        "rollout": {
            "over_sampling_batch_size": 3,
            "dynamic_sampling_filter_path": "rlcore.rollout:check_reward_nonzero_std",
        }
    }
    config = _config(tmp_path / "sync", **sections)
    sync_plan = plan(config)
    assert isinstance(sync_plan, TrainPlan)
    backend, sink = FakeBackend(), RecordingSink()
    run_training(
        sync_plan,
        backend,
        ScriptedEngine(every_third_always_right),
        label_reward,
        DATA,
        sink,
        Progress(),
    )
    overlapped, overlapped_sink = _direct(_config(tmp_path / "k0", **sections), 0)
    assert _seen(overlapped) == _seen(backend)
    assert _rows(overlapped_sink) == _rows(sink)
    assert all(
        m["rollout/staleness_max"] == 0
        for _, m in overlapped_sink.records
        if "rollout/staleness_max" in m
    )


@settings(deadline=None)
@given(
    k=st.integers(0, 3),
    batch=st.integers(1, 3),
    n=st.integers(2, 3),
    rollouts=st.integers(1, 6),
    save_interval=st.sampled_from([None, 1, 2, 3]),
    keep_surplus=st.booleans(),
    warmup=st.integers(0, 1),
    partial=st.booleans(),
)
def test_no_sample_is_older_than_k_and_no_group_is_lost(
    tmp_path_factory: Any,
    k: int,
    batch: int,
    n: int,
    rollouts: int,
    save_interval: int | None,
    keep_surplus: bool,
    warmup: int,
    partial: bool,
) -> None:
    warmup = min(warmup, rollouts - 1)
    config = _config(
        tmp_path_factory.mktemp("run"),
        rollout={
            "num_rollout": rollouts,
            "rollout_batch_size": batch,
            "n_samples_per_prompt": n,
            "over_sampling_batch_size": batch + 1,
            "over_sampling_surplus": "keep" if keep_surplus else "drop",
            "dynamic_sampling_filter_path": "rlcore.rollout:check_reward_nonzero_std",
        },
        algorithm={"sft_warmup_rollouts": warmup},
        train={"global_batch_size": n, "micro_batch_size": 1},
        checkpoint={"save_interval": save_interval},
        eval={"interval": None, "prompt_data": []},
    )
    the_plan = plan(config)
    assert isinstance(the_plan, TrainPlan)
    backend, sink = FakeBackend(), RecordingSink()
    run_overlapped_training(
        attrs.evolve(the_plan, max_staleness=k, partial_rollout=partial and k > 1),
        backend,
        ScriptedEngine(every_third_always_right),
        label_reward,
        DATA,
        sink,
        Progress(),
    )
    batches = backend.training_stacks[0].batches
    assert len(batches) == rollouts
    for rollout_id, trained in enumerate(batches[warmup:], start=warmup):
        assert len(trained.samples) == batch * n
        assert all(rollout_id - s.response.first_weight_version <= k for s in trained.samples)
    rows = [m for _, m in sink.records if "rollout/groups_generated" in m]
    assert len(rows) == rollouts - warmup
    # Every group that passed the filter was trained on, carried into the next rollout, or
    # dropped and counted: surplus (when not kept, or at the end), or too stale to carry.
    for before, after in zip(rows, rows[1:], strict=False):
        kept_over = before["rollout/groups_surplus"] if keep_surplus else 0.0
        assert after["rollout/groups_carried"] + after["rollout/stale_dropped"] == kept_over
    for m in rows:
        assert (
            m["rollout/groups_kept"] + m["rollout/groups_carried"]
            == batch + m["rollout/groups_surplus"]
        )


class _StopAfter(RecordingSink):
    """Ctrl-C right after rollout number ``last`` was trained and saved."""

    def __init__(self, last: int) -> None:
        super().__init__()
        self.last = last

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        super().log(step, metrics)
        if step == self.last and "train/actor/loss" in metrics:
            raise KeyboardInterrupt


@pytest.mark.parametrize("k", [0, 1])
def test_a_stopped_and_resumed_lockstep_run_equals_an_uninterrupted_one(
    tmp_path: Path, k: int
) -> None:
    sections: dict[str, dict[str, Any]] = {
        "rollout": {
            "over_sampling_batch_size": 3,
            "over_sampling_surplus": "keep",
            "dynamic_sampling_filter_path": "rlcore.rollout:check_reward_nonzero_std",
        },
        "eval": {"interval": None, "prompt_data": []},
    }
    straight, _ = _direct(_config(tmp_path / "a", **sections), k)
    config = _config(tmp_path / "b", **sections)
    trained_plan = plan(config)
    assert isinstance(trained_plan, TrainPlan)
    the_plan = attrs.evolve(trained_plan, max_staleness=k)
    first = FakeBackend()
    with pytest.raises(KeyboardInterrupt):
        run_overlapped_training(
            the_plan,
            first,
            ScriptedEngine(every_third_always_right),
            label_reward,
            DATA,
            _StopAfter(4),
            Progress(),
        )
    # (files inside a checkpoint keep the loop's rollout ids, from 0)
    saved = tmp_path / "b" / "ckpt" / "rollout_000004" / "rollout" / "pending_000004.json"
    assert saved.is_file() == (k == 1)  # K = 1 had generated rollout id 4 ahead: it is kept
    resumed = FakeBackend()
    run_overlapped_training(
        attrs.evolve(the_plan, load=tmp_path / "b" / "ckpt"),
        resumed,
        ScriptedEngine(every_third_always_right),
        label_reward,
        DATA,
        RecordingSink(),
        Progress(),
    )
    assert _seen(first)[:4] == _seen(straight)[:4]
    assert _seen(resumed) == _seen(straight)[4:]


class _Restarting:
    """A :class:`~rlcore.protocols.engine.RestartingEngine`: a scripted engine that records where
    the loop says the weights it serves are."""

    def __init__(self) -> None:
        self.inner = ScriptedEngine(every_third_always_right)
        self.sources: list[WeightSource | None] = []

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        return self.inner.generate(prompts, params)

    def receive_weights(self, version: int) -> AbstractContextManager[Sequence[WeightSink]]:
        return self.inner.receive_weights(version)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def restore_weights_from(self, source: WeightSource | None) -> None:
        self.sources.append(source)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_restarting_engine_is_told_who_holds_the_weights_it_serves(
    tmp_path: Path, max_staleness: int
) -> None:
    """After every push the synchronous schedule names the actor (it keeps the pushed weights
    while the engine generates); the off-policy one names nobody (the actor trains ahead)."""
    engine = _Restarting()
    config = _config(tmp_path, rollout={"max_staleness": max_staleness})
    the_plan = plan(config)
    assert isinstance(the_plan, TrainPlan)
    schedule = run_training if max_staleness == 0 else run_overlapped_training
    backend = FakeBackend()
    schedule(the_plan, backend, engine, label_reward, DATA, RecordingSink(), Progress())
    assert len(engine.sources) == len(engine.inner.updates) > 1
    if max_staleness == 0:
        assert all(source is not None for source in engine.sources)
    else:
        assert engine.sources == [None] * len(engine.sources)
