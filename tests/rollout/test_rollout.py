"""The rollout seam with the testing fakes: the default rollout (dynamic sampling), its errors,
loading users' functions, and rollouts saved to files and read back."""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import attrs
import pytest

from rlcore.config import load_config
from rlcore.data.sampler import PromptSampler
from rlcore.errors import ConfigError, DataError, RolloutError
from rlcore.loop import RunData, run
from rlcore.loop.plan import plan
from rlcore.rollout import (
    DynamicSampling,
    RolloutContext,
    RolloutOutput,
    check_reward_nonzero_std,
    check_rollout_output,
    default_rollout,
    load_group_filter,
    load_rollout_function,
)
from rlcore.rollout.replay import load_rollout_data, rollout_data_path, save_rollout_data
from rlcore.samples import Generation, Prompt, Sample, SamplingParams
from rlcore.testing import FakeBackend, ScriptedEngine, label_reward
from rlcore.weights import WeightSink

PROMPTS = tuple(
    Prompt(index=i, text=f"{i}?", token_ids=(1, i + 3), label=str(i)) for i in range(12)
)
PARAMS = SamplingParams(max_new_tokens=4)


def every_third_always_right(prompt: Prompt, i: int) -> str:
    """Prompts 0, 3, 6, 9: every sample right (rewards all 1, filtered out); the others
    alternate right and wrong (kept)."""
    return prompt.label if prompt.index % 3 == 0 or i % 2 == 0 else "x"


def context(
    sampler: PromptSampler,
    engine: ScriptedEngine,
    *,
    over: int = 4,
    batch: int = 4,
    keep: bool = False,
    max_rounds: int = 8,
    with_filter: bool = True,
    carried: tuple[tuple[Sample, ...], ...] = (),
) -> RolloutContext:
    return RolloutContext(
        rollout_id=0,
        prompts=sampler,
        engine=engine,
        reward_fn=label_reward,
        params=PARAMS,
        n_samples_per_prompt=2,
        batch_size=batch,
        sampling=DynamicSampling(
            over_sampling_batch_size=over,
            max_rounds=max_rounds,
            keep_surplus=keep,
            group_filter=check_reward_nonzero_std if with_filter else None,
        ),
        carried=carried,
    )


def test_without_a_filter_it_is_one_round_of_exactly_the_batch() -> None:
    sampler, engine = PromptSampler(PROMPTS, 4, seed=1), ScriptedEngine(every_third_always_right)
    out = default_rollout(context(sampler, engine, with_filter=False))
    order = PromptSampler(PROMPTS, 4, seed=1).next_batch()
    assert [g[0].prompt for g in out.groups] == list(order)
    assert all(len(g) == 2 and g[0].prompt == g[1].prompt for g in out.groups)
    assert [n for n, _ in engine.calls] == [8]  # one engine call, n per prompt
    assert sampler.consumed == 4 and out.surplus == ()
    assert out.metrics == {
        "rollout/groups_generated": 4.0,
        "rollout/groups_filtered": 0.0,
        "rollout/groups_kept": 4.0,
        "rollout/groups_carried": 0.0,
        "rollout/groups_surplus": 0.0,
        "rollout/sampling_rounds": 1.0,
    }


def test_dynamic_sampling_tops_up_until_enough_groups_pass() -> None:
    sampler, engine = PromptSampler(PROMPTS, 4, seed=1), ScriptedEngine(every_third_always_right)
    out = default_rollout(context(sampler, engine, over=3))
    stream = PromptSampler(PROMPTS, 4, seed=1).take(sampler.consumed)
    passing = [p for p in stream if p.index % 3 != 0]
    assert [g[0].prompt for g in out.groups] == passing[:4]  # stream order, first four passing
    assert all(check_reward_nonzero_std(g) for g in out.groups)
    m = out.metrics
    rounds = int(m["rollout/sampling_rounds"])
    assert sampler.consumed == 3 * rounds and [n for n, _ in engine.calls] == [6] * rounds
    assert m["rollout/groups_generated"] == 3 * rounds
    assert m["rollout/groups_filtered"] == sum(p.index % 3 == 0 for p in stream)
    assert m["rollout/groups_kept"] == len(passing)
    assert m["rollout/groups_surplus"] == len(passing) - 4
    assert out.surplus == ()  # dropped, as slime does


def test_kept_surplus_groups_come_first_in_the_next_rollout() -> None:
    sampler, engine = PromptSampler(PROMPTS, 4, seed=2), ScriptedEngine(every_third_always_right)
    first = default_rollout(context(sampler, engine, over=7, keep=True))
    assert first.surplus and first.metrics["rollout/groups_surplus"] == len(first.surplus)
    calls = len(engine.calls)
    second = default_rollout(context(sampler, engine, over=7, keep=True, carried=first.surplus))
    assert second.groups[: len(first.surplus)] == first.surplus[:4]
    assert second.metrics["rollout/groups_carried"] == len(first.surplus)
    if len(first.surplus) >= 4:
        assert len(engine.calls) == calls  # enough carried: nothing generated


def test_a_filter_that_never_passes_stops_after_the_round_limit() -> None:
    sampler, engine = PromptSampler(PROMPTS, 4, seed=1), ScriptedEngine(lambda p, i: p.label)
    with pytest.raises(RolloutError) as info:
        default_rollout(context(sampler, engine, over=4, max_rounds=3))
    message = str(info.value)
    assert "after 3 generation rounds only 0 of 4 groups passed" in message
    assert "12 generated, 12 filtered out" in message
    assert "--dynamic-sampling-max-rounds" in message and "--over-sampling-batch-size" in message
    assert len(engine.calls) == 3


def test_a_filter_that_raises_is_named() -> None:
    def broken(group: Sequence[Sample]) -> bool:
        raise KeyError("reward_details")

    sampler = PromptSampler(PROMPTS, 4, seed=1)
    ctx = attrs.evolve(
        context(sampler, ScriptedEngine()),
        sampling=DynamicSampling(over_sampling_batch_size=4, group_filter=broken),
    )
    with pytest.raises(RolloutError, match=r"group filter .*broken raised KeyError"):
        default_rollout(ctx)


class ShortEngine:
    """Breaks the engine contract: one generation fewer than asked."""

    def __init__(self) -> None:
        self.inner = ScriptedEngine()

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Generation]:
        return self.inner.generate(prompts, params)[:-1]

    def receive_weights(self, version: int) -> AbstractContextManager[Sequence[WeightSink]]:
        return self.inner.receive_weights(version)

    @property
    def weight_version(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_an_engine_returning_too_few_generations_is_a_rollout_error() -> None:
    ctx = attrs.evolve(context(PromptSampler(PROMPTS, 4, seed=1), ScriptedEngine()))
    ctx = attrs.evolve(ctx, engine=ShortEngine())
    with pytest.raises(RolloutError, match="ShortEngine returned 7 generations for 8 requests"):
        default_rollout(ctx)


def test_the_output_check_names_the_function() -> None:
    sample = default_rollout(context(PromptSampler(PROMPTS, 4, seed=1), ScriptedEngine())).groups
    assert check_rollout_output(RolloutOutput(sample), "mine", 4, 2).groups == sample
    with pytest.raises(RolloutError, match="mine returned 3 groups of sizes"):
        check_rollout_output(RolloutOutput(sample[:3]), "mine", 4, 2)
    with pytest.raises(RolloutError, match="mine returned 4 groups of sizes \\[1, 2, 2, 2\\]"):
        check_rollout_output(RolloutOutput((sample[0][:1], *sample[1:])), "mine", 4, 2)
    with pytest.raises(RolloutError, match="mine returned list, not a RolloutOutput"):
        check_rollout_output(list(sample), "mine", 4, 2)


def test_a_rollout_function_that_raises_is_named_with_the_rollout(tmp_path: Path) -> None:
    def mine(ctx: RolloutContext) -> RolloutOutput:
        raise ZeroDivisionError("oops")

    config = load_config(
        [
            *("--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
            *("--global-batch-size", "4", "--micro-batch-size", "1"),
        ]
    )
    with pytest.raises(RolloutError) as info:
        run(
            plan(config),
            FakeBackend(),
            ScriptedEngine(),
            label_reward,
            RunData(PROMPTS),
            rollout_fn=mine,
        )
    assert str(info.value) == (
        "rollout function test_a_rollout_function_that_raises_is_named_with_the_rollout.<locals>"
        ".mine raised ZeroDivisionError: oops at rollout 1; fix the rollout function given to "
        "rlcore.run"
    )


def test_the_built_in_filter_drops_groups_whose_rewards_all_equal() -> None:
    gen = Generation((), (), "")

    def group(*rewards: float) -> tuple[Sample, ...]:
        return tuple(Sample(PROMPTS[0], gen, r, 0) for r in rewards)

    assert check_reward_nonzero_std(group(0.0, 1.0))
    assert check_reward_nonzero_std(group(0.5, 0.5, 0.6))
    assert not check_reward_nonzero_std(group(1.0, 1.0, 1.0))
    assert not check_reward_nonzero_std(group(0.3))  # one sample has no spread


def test_user_functions_load_from_either_spelling_and_bad_paths_name_the_flag() -> None:
    assert load_group_filter("rlcore.rollout:check_reward_nonzero_std") is check_reward_nonzero_std
    assert load_group_filter("rlcore.rollout.check_reward_nonzero_std") is check_reward_nonzero_std
    assert load_rollout_function("rlcore.rollout:default_rollout") is default_rollout
    cases = {
        "no_such_module_xyz:fn": "cannot import module 'no_such_module_xyz'",
        "rlcore.rollout:nope": "has no attribute 'nope'",
        "rlcore.rollout:DEFAULT_MAX_ROUNDS": "is not a function (it is of type int)",
        "rlcore.rollout:check_rollout_output": "cannot be called with 1 argument",
        "justaname": "expected 'module:function'",
    }
    for path, message in cases.items():
        with pytest.raises(ConfigError, match="--rollout-function-path") as info:
            load_rollout_function(path)
        assert message in str(info.value), path
    with pytest.raises(ConfigError, match="--dynamic-sampling-filter-path"):
        load_group_filter("rlcore.rollout:nope")


# --- rollouts saved to files ----------------------------------------------------------------


def saved_groups() -> tuple[tuple[Sample, ...], ...]:
    groups = default_rollout(context(PromptSampler(PROMPTS, 4, seed=3), ScriptedEngine())).groups
    # Floats that are not short decimals, and a version: all must come back exactly.
    odd = attrs.evolve(
        groups[0][0],
        reward=0.1 + 0.2,
        response=attrs.evolve(
            groups[0][0].response,
            log_probs=tuple(-1 / 3 for _ in groups[0][0].response.token_ids),
            weight_version=7,
        ),
    )
    return ((odd, groups[0][1]), *groups[1:])


def test_saved_rollouts_read_back_exactly(tmp_path: Path) -> None:
    groups = saved_groups()
    template = str(tmp_path / "debug" / "rollout_{rollout_id}.json")
    path = save_rollout_data(template, 3, groups)  # rollout id 3: the fourth rollout
    assert path == tmp_path / "debug" / "rollout_4.json"
    assert load_rollout_data(template, 3) == groups
    assert [p.name for p in (tmp_path / "debug").iterdir()] == ["rollout_4.json"]  # no temp file
    folder = str(tmp_path / "as_folder")  # no placeholder: a folder of numbered files
    assert save_rollout_data(folder, 12, groups) == Path(folder) / "rollout_000013.json"
    assert rollout_data_path(folder, 12) == Path(folder) / "rollout_000013.json"
    assert load_rollout_data(folder, 12) == groups


def test_bad_rollout_files_name_the_file(tmp_path: Path) -> None:
    template = str(tmp_path / "r{rollout_id}.json")
    # Files are named by the rollouts' numbers (rollout id 0 is rollout 1) and record the id.
    with pytest.raises(DataError, match=r"r6\.json: no saved rollout 6"):
        load_rollout_data(template, 5)
    save_rollout_data(template, 0, saved_groups())
    (tmp_path / "r1.json").rename(tmp_path / "r2.json")
    with pytest.raises(DataError, match=r"r2\.json: holds rollout 1, not 2; .* rename them one"):
        load_rollout_data(template, 1)
    (tmp_path / "r3.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DataError, match="not a rollout file of format 'rlcore.rollout/1'"):
        load_rollout_data(template, 2)
    (tmp_path / "r4.json").write_text('{"format": "rlcore.rollout/1", "rollout_id": 3, "groups"')
    with pytest.raises(DataError, match=r"r4\.json: cannot read saved rollout 4"):
        load_rollout_data(template, 3)
    record = {"format": "rlcore.rollout/1", "rollout_id": 5, "groups": [[{"reward": 1.0}]]}
    (tmp_path / "r6.json").write_text(json.dumps(record))
    with pytest.raises(DataError, match=r"r6\.json: malformed rollout 6"):
        load_rollout_data(template, 5)
