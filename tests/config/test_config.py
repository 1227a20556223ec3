"""Config loading: flags and TOML give one result; every broken invariant is one ConfigError."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.config import RolloutConfig, RunConfig, float_fields, structure_config
from rlcore.config.flags import build_parser, load_config
from rlcore.errors import ConfigError, ConfigProblem
from rlcore.loop.plan import TrainPlan, plan
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


def test_eval_prompt_data_takes_name_path_pairs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("a.jsonl", "b.jsonl"):
        Path(name).touch()
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


def test_expert_parallel_flags_reach_the_model_spec_and_are_checked() -> None:
    flags = [*TRAIN, "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    the_plan = plan(
        load_config([*flags, "--actor-num-gpus-per-node", "4", "--moe-aux-loss-coeff", "0.01"])
    )
    assert isinstance(the_plan, TrainPlan)
    model = the_plan.actor.model
    assert (model.parallel.expert, model.moe_aux_loss_coeff) == (2, 0.01)
    # 2 ranks cannot hold experts split over 2 TP ranks in 2 expert-parallel groups
    joined = "\n".join(
        _problems([*flags, "--actor-num-gpus-per-node", "2", "--moe-aux-loss-coeff", "-1"])
    )
    assert "model.expert_model_parallel_size (--expert-model-parallel-size)" in joined
    assert "model.moe_aux_loss_coeff (--moe-aux-loss-coeff)" in joined


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


def test_prompt_files_that_do_not_exist_are_named_with_their_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("there.jsonl").touch()
    Path("folder.jsonl").mkdir()
    argv = ["--prompt-data", "missing.jsonl", "--eval-prompt-data", "a", "there.jsonl"]
    argv += ["b", "folder.jsonl", "c", "gone.jsonl"]
    assert _problems([*TRAIN, *argv]) == [
        "data.prompt_data (--prompt-data): missing.jsonl does not exist (check the path; a "
        "relative path is read from the current folder)",
        "eval.prompt_data (--eval-prompt-data): folder.jsonl is not a file (check the path; a "
        "relative path is read from the current folder)",
        "eval.prompt_data (--eval-prompt-data): gone.jsonl does not exist (check the path; a "
        "relative path is read from the current folder)",
    ]


def test_num_rollout_zero_needs_something_to_evaluate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert any("nothing to evaluate" in p for p in _problems(["--num-rollout", "0"]))
    monkeypatch.chdir(tmp_path)
    Path("x.jsonl").touch()
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
    # The sections' types are strings until resolved (PEP 563); alone, this test sees them so.
    for section in attrs.fields(attrs.resolve_types(RunConfig)):
        owner = section.type
        fields = attrs.fields(owner) if isinstance(owner, type) and attrs.has(owner) else [section]
        for f in fields:
            if f.name not in ("name", "path"):
                assert f.metadata.get("help"), f"{section.name}.{f.name} has no help text"


SLIME_FLAGS = (
    "--rollout-function-path",
    "--over-sampling-batch-size",
    "--dynamic-sampling-filter-path",
    "--use-rollout-logprobs",
    "--use-tis",
    "--tis-clip",
    "--tis-clip-low",
    "--custom-tis-function-path",
    "--calculate-per-token-loss",
    "--save-debug-rollout-data",
    "--load-debug-rollout-data",
    "--debug-rollout-only",
    "--debug-train-only",
)


def test_the_algorithm_flags_keep_slimes_names() -> None:
    flags = {o for a in build_parser()._actions for o in a.option_strings}
    assert set(SLIME_FLAGS) <= flags
    config = load_config(
        [
            *TRAIN,
            "--over-sampling-batch-size",
            "6",
            "--dynamic-sampling-filter-path",
            "rlcore.rollout:check_reward_nonzero_std",
            "--over-sampling-surplus",
            "keep",
            "--use-tis",
            "--tis-clip",
            "3",
            "--tis-clip-low",
            "0.5",
            "--tis-mode",
            "mask",
            "--tis-level",
            "geometric",
            "--tis-veto-threshold",
            "1e-4",
            "--calculate-per-token-loss",
            "--advantage-estimator",
            "gspo",
            "--save-debug-rollout-data",
            "debug/{rollout_id}.json",
        ]
    )
    r, a = config.rollout, config.algorithm
    assert (r.over_sampling_batch_size, r.over_sampling_surplus) == (6, "keep")
    assert (a.tis_clip, a.tis_clip_low, a.tis_mode, a.tis_level) == (3.0, 0.5, "mask", "geometric")
    assert a.tis_veto_threshold == 1e-4 and a.agg_mode == "token-mean"
    assert config.debug.save_debug_rollout_data == "debug/{rollout_id}.json"


def test_the_new_flags_refuse_combinations_that_mean_nothing() -> None:
    cases = {
        ("--over-sampling-batch-size", "2"): "rollout.over_sampling_batch_size "
        "(--over-sampling-batch-size): 2 is less than --rollout-batch-size 4",
        ("--dynamic-sampling-max-rounds", "0"): "--dynamic-sampling-max-rounds): must be >= 1",
        ("--use-tis", "--use-rollout-logprobs"): "cannot be combined with --use-rollout-logprobs",
        ("--use-tis", "--tis-clip", "0.9"): "0 <= --tis-clip-low <= 1 <= --tis-clip",
        ("--use-tis", "--tis-veto-threshold", "2"): "--tis-veto-threshold): must be in (0, 1)",
        ("--tis-mode", "mask"): "algorithm.tis_mode (--tis-mode): has no effect without --use-tis",
        ("--custom-tis-function-path", "m:f"): "has no effect without --use-tis",
        ("--calculate-per-token-loss", "--loss-agg-mode", "seq-mean-token-sum-budget"): "give one",
        ("--debug-train-only",): "--load-debug-rollout-data is not given",
        ("--debug-rollout-only", "--load-debug-rollout-data", "x"): "cannot be combined",
        ("--load-debug-rollout-data", "x", "--save-debug-rollout-data", "y"): "generates none",
        (
            "--load-debug-rollout-data",
            "x",
            "--eval-interval",
            "1",
            "--eval-prompt-data",
            "h",
            "p",
        ): ("cannot evaluate (--eval-interval)"),
    }
    for flags, message in cases.items():
        problems = _problems([*TRAIN, *flags])
        assert any(message in p for p in problems), (flags, problems)
    assert any(
        "the debug flags need rollouts" in p
        for p in _problems(
            ["--num-rollout", "0", "--debug-rollout-only", "--eval-prompt-data", "h", "p"]
        )
    )
    assert any(
        "gspo compares samples within a prompt's group" in p
        for p in _problems(
            [
                *TRAIN[:-6],
                "--n-samples-per-prompt",
                "1",
                "--global-batch-size",
                "4",
                "--micro-batch-size",
                "4",
                "--advantage-estimator",
                "gspo",
            ]
        )
    )


NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
FLOAT_FIELDS = st.sampled_from(float_fields())


@given(FLOAT_FIELDS, NON_FINITE, st.sampled_from(["flags", "toml", "python"]))
def test_every_float_field_refuses_nan_and_infinity_naming_that_field(
    field: tuple[str, type[Any], str], value: float, source: str
) -> None:
    section, owner, name = field
    path = f"{section}.{name}" if section else name
    flag = attrs.fields_dict(owner)[name].metadata["flag"]
    with pytest.raises(ConfigError) as info:
        if source == "flags":  # `--lr=nan`: the form argparse takes for "-inf" too
            load_config([*TRAIN, f"{flag}={value}"])
        elif source == "toml":  # TOML has nan and inf; tomllib gives floats
            data: dict[str, Any] = {"rollout": {"num_rollout": 3}}
            (data.setdefault(section, {}) if section else data)[name] = value
            structure_config(data)
        else:
            kwargs: dict[str, Any] = {"rollout": RolloutConfig(num_rollout=3)}
            if section:
                default: Any = attrs.fields_dict(RunConfig)[section].default
                kwargs[section] = attrs.evolve(kwargs.get(section, default), **{name: value})
            else:
                kwargs[name] = value
            RunConfig(**kwargs)
    assert info.value.paths == (f"{path} ({flag})",)
    assert f"must be a finite number, got {value}" in str(info.value)


def test_nan_lr_is_blamed_on_lr_not_min_lr() -> None:
    assert _problems([*TRAIN, "--lr", "nan", "--rollout-temperature", "nan"]) == [
        "rollout.temperature (--rollout-temperature): must be a finite number, got nan",
        "optim.lr (--lr): must be a finite number, got nan",
    ]


def test_config_errors_survive_pickling_whole() -> None:
    """Ray pickles a rank's errors to the driver; the default pickling rebuilt a ConfigError from
    its message and listed that one character per line."""
    error = ConfigError([ConfigProblem("model_type", "'bert' is not supported", "use llama")], "c")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.problems == error.problems and copy.source == "c" and str(copy) == str(error)


def test_off_policy_schedule_flags_are_checked() -> None:
    assert any(
        p.startswith(
            "rollout.partial_rollout (--partial-rollout): has no effect with --max-staleness 1"
        )
        for p in _problems([*TRAIN, "--max-staleness", "1", "--partial-rollout"])
    )
    assert any(
        p.startswith("rollout.max_staleness (--max-staleness): must be >= 0")
        for p in _problems([*TRAIN, "--max-staleness", "-1"])
    )
    assert any(
        "use_rollout_logprobs (--use-rollout-logprobs): cannot be combined with --max-staleness 2"
        in p
        for p in _problems([*TRAIN, "--max-staleness", "2", "--use-rollout-logprobs"])
    )
    assert any(
        p.startswith(
            "rollout.use_fault_tolerance (--use-fault-tolerance): cannot be combined with "
            "--max-staleness 1: a restarted server must get the weights the others serve"
        )
        for p in _problems([*TRAIN, "--max-staleness", "1", "--use-fault-tolerance"])
    )
    replay = ["--load-debug-rollout-data", "x", "--debug-train-only", "--max-staleness", "1"]
    assert any("only replays saved rollouts" in p for p in _problems([*TRAIN, *replay]))
    colocated = ["--rollout-engine", "sglang", "--colocate", "--max-staleness", "1"]
    assert any(
        p.startswith("cluster.colocate (--colocate): puts the rollout servers on the actor's GPUs")
        for p in _problems([*TRAIN, *colocated])
    )
    # An off-policy schedule implies the importance-sampling correction, with its flags.
    config = load_config([*TRAIN, "--max-staleness", "2", "--tis-mode", "mask"])
    the_plan = plan(config)
    assert isinstance(the_plan, TrainPlan)
    assert the_plan.max_staleness == 2 and the_plan.actor.loss.correction is not None
    assert the_plan.actor.loss.correction.mode == "mask"
    assert any(
        "has no effect without --use-tis" in p for p in _problems([*TRAIN, "--tis-mode", "mask"])
    )


def test_restarts_need_a_checkpoint_to_go_on_from() -> None:
    restarts = ["--max-restarts", "1"]
    assert _problems([*TRAIN, *restarts]) == [
        "checkpoint.max_restarts (--max-restarts): restarts resume from the run's latest "
        "checkpoint, but there is no save folder (add --save DIR, with --save-interval N to lose "
        "at most N rollouts to a restart)"
    ]
    assert any(
        p.startswith("checkpoint.max_restarts (--max-restarts): must be >= 0")
        for p in _problems([*TRAIN, "--max-restarts", "-1"])
    )
    eval_only = ["--num-rollout", "0", "--eval-prompt-data", "e", __file__, "--save", "c"]
    assert any("--num-rollout 0 trains nothing" in p for p in _problems([*eval_only, *restarts]))
    rollout_only = [*TRAIN, "--debug-rollout-only", "--save", "c", *restarts]
    assert any("this run only generates" in p for p in _problems(rollout_only))
    config = load_config([*TRAIN, "--save", "c", *restarts])
    assert config.checkpoint.max_restarts == 1


@pytest.mark.parametrize("value", ["-1e-6", "-0.5", "-3", "-.5", "-inf"])
def test_a_negative_value_reaches_its_own_check(value: str) -> None:
    """``--lr -1e-6`` was read by argparse as a flag of its own and reported as ``--lr``
    missing its value; a negative number after a flag is that flag's value."""
    problems = _problems([*TRAIN, "--lr", value])
    assert any(p.startswith("optim.lr (--lr): must be") for p in problems), problems
    assert problems == _problems([*TRAIN, f"--lr={value}"])


def test_token_budget_flags_keep_slimes_names_and_reach_every_spec(tmp_path: Path) -> None:
    budget = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096"]
    the_plan = plan(load_config([*TRAIN, *budget, "--advantage-estimator", "ppo", "--use-kl-loss"]))
    assert isinstance(the_plan, TrainPlan) and the_plan.critic and the_plan.reference
    assert the_plan.actor.max_tokens_per_gpu == the_plan.critic.max_tokens_per_gpu == 4096
    # the forward-only passes default to the train budget, and take their own
    for spec in (the_plan.actor.model, the_plan.critic.model, the_plan.reference.model):
        assert spec.log_probs_max_tokens_per_gpu == 4096
    own = load_config([*TRAIN, *budget, "--log-probs-max-tokens-per-gpu", "8192"])
    assert plan(own).actor.model.log_probs_max_tokens_per_gpu == 8192
    toml = tmp_path / "run.toml"
    toml.write_text(
        "[rollout]\nnum_rollout = 3\nrollout_batch_size = 4\nn_samples_per_prompt = 4\n"
        "[train]\nglobal_batch_size = 16\nmicro_batch_size = 4\nuse_dynamic_batch_size = true\n"
        "max_tokens_per_gpu = 4096\nlog_probs_max_tokens_per_gpu = 8192\n"
    )
    assert load_config(["--config", str(toml)]) == own
    # without the flag: by sample count, as before
    default = plan(load_config(TRAIN))
    assert isinstance(default, TrainPlan) and default.actor.max_tokens_per_gpu is None
    assert default.actor.model.log_probs_max_tokens_per_gpu is None


def test_token_budget_flags_are_checked() -> None:
    joined = "\n".join(_problems([*TRAIN, "--use-dynamic-batch-size"]))
    assert "train.max_tokens_per_gpu (--max-tokens-per-gpu)" in joined
    assert "needs a token budget" in joined and "add --max-tokens-per-gpu N" in joined
    joined = "\n".join(_problems([*TRAIN, "--max-tokens-per-gpu", "100"]))
    assert "only used with --use-dynamic-batch-size" in joined
    joined = "\n".join(
        _problems(
            [
                *TRAIN,
                "--use-dynamic-batch-size",
                "--max-tokens-per-gpu",
                "0",
                "--log-probs-max-tokens-per-gpu",
                "-3",
            ]
        )
    )
    assert "train.max_tokens_per_gpu (--max-tokens-per-gpu): must be >= 1, got 0" in joined
    assert "(--log-probs-max-tokens-per-gpu): must be >= 1, got -3" in joined


def test_an_eval_only_run_scores_by_the_token_budget(tmp_path: Path) -> None:
    data = tmp_path / "a.jsonl"
    data.write_text('{"prompt": "1+1", "label": "2"}\n')
    flags = ["--num-rollout", "0", "--eval-prompt-data", "a", str(data)]
    the_plan = plan(
        load_config([*flags, "--use-dynamic-batch-size", "--max-tokens-per-gpu", "512"])
    )
    assert the_plan.actor.model.log_probs_max_tokens_per_gpu == 512
