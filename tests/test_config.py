"""Config loading: flags and TOML give one result; every broken invariant is one ConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given

from rlcore.config import RunConfig, structure_config
from rlcore.errors import ConfigError
from rlcore.flags import build_parser, load_config
from tests.strategies import config_dicts, corrupted_config_dicts

TRAIN = [
    "--num-rollout",
    "3",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "4",
    "--global-batch-size",
    "16",
    "--micro-batch-size",
    "4",
]


def _problems(argv: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    return [str(p) for p in info.value.problems]


@given(config_dicts())
def test_loading_yields_a_config_or_a_config_error(data: dict[str, Any]) -> None:
    try:
        config = structure_config(data)
    except ConfigError as exc:
        assert exc.problems, "a ConfigError always lists at least one problem"
        return
    assert isinstance(config, RunConfig)


@given(corrupted_config_dicts())
def test_junk_values_and_unknown_keys_are_config_errors_naming_the_path(
    data: dict[str, Any],
) -> None:
    try:
        structure_config(data)
    except ConfigError as exc:
        assert all(p.path for p in exc.problems)


def test_flags_override_the_toml_file(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[rollout]\nnum_rollout = 5\nrollout_batch_size = 4\nn_samples_per_prompt = 4\n"
        "[train]\nglobal_batch_size = 16\nmicro_batch_size = 4\n[optim]\nlr = 2e-6\n"
    )
    config = load_config(["--config", str(toml), "--num-rollout", "7"])
    assert config.rollout.num_rollout == 7
    assert config.optim.lr == 2e-6
    assert config.rollout.rollout_batch_size == 4


def test_flags_and_toml_give_the_same_config(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[rollout]\nnum_rollout = 3\nrollout_batch_size = 4\nn_samples_per_prompt = 4\n"
        "[train]\nglobal_batch_size = 16\nmicro_batch_size = 4\n"
    )
    assert load_config(["--config", str(toml)]) == load_config(TRAIN)


def test_ppo_implies_a_critic() -> None:
    config = load_config([*TRAIN, "--advantage-estimator", "ppo"])
    assert config.algorithm.critic and not config.algorithm.use_critic


def test_advantage_normalisation_flags() -> None:
    default = load_config(TRAIN).algorithm
    assert default.normalize_std and not default.normalize_advantages
    changed = load_config(
        [*TRAIN, "--disable-grpo-std-normalization", "--normalize-advantages"]
    ).algorithm
    assert not changed.normalize_std and changed.normalize_advantages


def test_precision_and_optimizer_flags_keep_slimes_names() -> None:
    default = load_config(TRAIN)
    assert not default.model.bf16 and not default.optim.use_distributed_optimizer  # fp32
    changed = load_config([*TRAIN, "--bf16", "--use-distributed-optimizer"])
    assert changed.model.bf16 and changed.optim.use_distributed_optimizer


def test_eval_prompt_data_takes_name_path_pairs() -> None:
    config = load_config([*TRAIN, "--eval-prompt-data", "a", "a.jsonl", "b", "b.jsonl"])
    assert [(d.name, d.path) for d in config.eval.prompt_data] == [
        ("a", Path("a.jsonl")),
        ("b", Path("b.jsonl")),
    ]
    assert any("NAME PATH" in p for p in _problems([*TRAIN, "--eval-prompt-data", "a"]))


def test_all_problems_are_reported_together_with_paths_and_flags() -> None:
    problems = _problems(
        [
            "--num-rollout",
            "2",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "8",
            "--eval-interval",
            "1",
            "--save-interval",
            "1",
        ]
    )
    joined = "\n".join(problems)
    assert "train.global_batch_size (--global-batch-size)" in joined
    assert "eval.prompt_data" in joined and "--eval-prompt-data" in joined
    assert "checkpoint.save (--save)" in joined
    assert len(problems) == 3


def test_lr_decay_steps_below_one_is_refused_at_load_time() -> None:
    # 1 rollout x 1 step: decay 1 step, and warmup 1 is not shorter.
    problems = _problems(
        [
            "--num-rollout",
            "1",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "4",
            "--micro-batch-size",
            "4",
            "--lr-warmup-iters",
            "1",
        ]
    )
    assert any("lr_warmup_iters" in p for p in problems)
    problems = _problems([*TRAIN, "--lr-decay-iters", "0"])
    assert any("lr_decay_iters" in p and ">= 1" in p for p in problems)


def test_num_rollout_zero_needs_something_to_evaluate() -> None:
    assert any("nothing to evaluate" in p for p in _problems(["--num-rollout", "0"]))
    config = load_config(
        [
            "--num-rollout",
            "0",
            "--eval-prompt-data",
            "x",
            "x.jsonl",
            "--use-critic",
            "--global-batch-size",
            "1000",
        ]
    )
    assert config.is_eval_only  # batch sizes do not matter when nothing trains


def test_unknown_flags_and_keys_get_a_suggestion(tmp_path: Path) -> None:
    assert any("did you mean --lr?" in p for p in _problems([*TRAIN, "--lrr", "3"]))
    toml = tmp_path / "run.toml"
    toml.write_text("[rollout]\nnum_rolout = 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(toml)])
    assert "did you mean 'num_rollout'?" in str(info.value)
    assert str(toml) in str(info.value)


def test_wrong_types_are_not_coerced() -> None:
    with pytest.raises(ConfigError, match="expected an integer"):
        structure_config({"rollout": {"num_rollout": 2.5}})
    with pytest.raises(ConfigError, match="expected true or false"):
        structure_config({"rollout": {"num_rollout": 0}, "algorithm": {"use_critic": "no"}})


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text("[rollout\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_config(["--config", str(toml)])


def test_every_field_has_a_flag_and_help() -> None:
    parser = build_parser()
    flags = {o for a in parser._actions for o in a.option_strings}
    for name in (
        "--num-rollout",
        "--num-epoch",
        "--rollout-batch-size",
        "--n-samples-per-prompt",
        "--global-batch-size",
        "--use-critic",
        "--advantage-estimator",
        "--kl-coef",
        "--use-kl-loss",
        "--kl-loss-coef",
        "--kl-loss-type",
        "--lr",
        "--min-lr",
        "--lr-warmup-iters",
        "--lr-decay-iters",
        "--lr-decay-style",
        "--clip-grad",
        "--eps-clip",
        "--eps-clip-high",
        "--eval-interval",
        "--eval-prompt-data",
        "--skip-eval-before-train",
        "--save",
        "--save-interval",
        "--load",
        "--start-rollout-id",
        "--seed",
        "--bf16",
        "--use-distributed-optimizer",
    ):
        assert name in flags
    for section in attrs.fields(RunConfig):
        fields = attrs.fields(section.type) if attrs.has(section.type) else [section]  # type: ignore[arg-type]
        for f in fields:
            if f.name not in ("name", "path"):
                assert f.metadata.get("help"), f"{section.name}.{f.name} has no help text"
