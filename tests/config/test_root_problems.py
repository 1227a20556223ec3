"""A setting that is wrong is reported once, by its flag: what is derived from it (a bound, a
step count, "no eval data") does not fail again (``rlcore.config.fields.root_problems``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlcore.config.flags import load_config
from rlcore.errors import ConfigError
from rlcore.launch.cli import main

# A training run in which every count below means something: eval data and an interval, a save
# folder with an interval and a retention, a warm start, sampling, a schedule with warmup.
BASE = {
    "--num-rollout": "4",
    "--rollout-batch-size": "4",
    "--n-samples-per-prompt": "2",
    "--global-batch-size": "8",
    "--micro-batch-size": "4",
    "--rollout-max-response-len": "5",
    "--sft-warmup-rollouts": "1",
    "--lr-warmup-iters": "1",
    "--eval-interval": "2",
    "--n-samples-per-eval-prompt": "1",
    "--eval-max-response-len": "5",
    "--save-interval": "2",
    "--save-retain": "2",
    "--max-restarts": "1",
    "--rollout-top-k": "0",
    "--dynamic-sampling-max-rounds": "2",
    "--rollout-max-prompt-len": "8",
    "--max-staleness": "0",
    "--tensor-model-parallel-size": "1",
    "--actor-num-nodes": "1",
    "--actor-num-gpus-per-node": "1",
}
COUNTS = {  # flag: its smallest valid value
    "--num-rollout": 0,
    "--rollout-batch-size": 1,
    "--n-samples-per-prompt": 1,
    "--global-batch-size": 1,
    "--micro-batch-size": 1,
    "--rollout-max-response-len": 1,
    "--sft-warmup-rollouts": 0,
    "--lr-warmup-iters": 0,
    "--eval-interval": 1,
    "--n-samples-per-eval-prompt": 1,
    "--eval-max-response-len": 1,
    "--save-interval": 1,
    "--save-retain": 1,
    "--max-restarts": 0,
    "--rollout-top-k": 0,
    "--dynamic-sampling-max-rounds": 1,
    "--rollout-max-prompt-len": 1,
    "--max-staleness": 0,
    "--tensor-model-parallel-size": 1,
    "--actor-num-nodes": 1,
    "--actor-num-gpus-per-node": 1,
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("data")
    for name in ("train.jsonl", "eval.jsonl"):
        (folder / name).write_text('{"input": "1+1=", "label": "2"}\n')
    return [
        *("--prompt-data", str(folder / "train.jsonl")),
        *("--eval-prompt-data", "heldout", str(folder / "eval.jsonl")),
        *("--save", str(folder / "ckpt")),
    ]


def _flags(files: list[str], **given: str) -> list[str]:
    values = {**BASE, **{f"--{k.replace('_', '-')}": v for k, v in given.items()}}
    return [*files, *(x for flag, value in values.items() for x in (flag, value))]


def test_the_base_run_is_valid(files: list[str]) -> None:
    assert load_config(_flags(files)).rollout.num_rollout == 4


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(sorted(COUNTS)), st.integers(min_value=-(10**6), max_value=-1))
def test_any_single_invalid_count_is_one_problem_naming_its_flag(
    files: list[str], flag: str, below: int
) -> None:
    value = COUNTS[flag] + below
    flags = [*_flags(files), flag, str(value)]  # the last of a repeated flag wins
    with pytest.raises(ConfigError) as info:
        load_config(flags)
    (problem,) = info.value.problems
    assert f"({flag})" in problem.path
    assert str(value) in problem.message


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--num-rollout", "-1"], "rollout.num_rollout (--num-rollout): must be >= 0, got -1"),
        (
            ["--num-rollout", "3", "--rollout-batch-size", "0"],
            "rollout.rollout_batch_size (--rollout-batch-size): must be >= 1, got 0",
        ),
        (
            ["--num-rollout", "0", "--eval-prompt-data", "TRAIN"],
            "eval.prompt_data (--eval-prompt-data): expects NAME PATH pairs, got 1 value: ",
        ),
        (
            ["--num-rollout", "0", "--eval-prompt-data", "TRAIN", "--eval-interval", "1"],
            "eval.prompt_data (--eval-prompt-data): expects NAME PATH pairs, got 1 value: ",
        ),
        (
            ["--num-rollout", "2", "--n-samples-per-prompt", "0"],
            "rollout.n_samples_per_prompt (--n-samples-per-prompt): must be >= 1, got 0",
        ),
    ],
)
def test_the_cli_reports_the_setting_given_and_not_its_echoes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], expected: str
) -> None:
    train = tmp_path / "train.jsonl"
    train.write_text('{"input": "1+1=", "label": "2"}\n')
    flags = [str(train) if f == "TRAIN" else f for f in flags]
    argv = ["--prompt-data", str(train), "--output-dir", str(tmp_path / "out"), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error: 1 configuration problem(s) in flags:" in err, err
    assert f"  - {expected}" in err
    assert not (tmp_path / "out").exists()


def test_a_derived_problem_stays_when_its_inputs_hold(files: list[str]) -> None:
    # 4 prompts x 2 samples are 8 samples: a global batch of 16 never fills, whatever else holds.
    with pytest.raises(ConfigError) as info:
        load_config(_flags(files, global_batch_size="16", micro_batch_size="16"))
    assert [p.path for p in info.value.problems] == [
        "train.global_batch_size (--global-batch-size)"
    ]
