"""Rollout engines by name, each with its own options (flags and a config-file section), and the
placement flags (slime's names) that say where ranks and servers go."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.config.flags import build_parser, load_config
from rlcore.engines import EMBEDDED, KNOWN_ENGINES, NoOptions, load_engine
from rlcore.errors import BackendUnavailableError, ConfigError
from rlcore_sglang.options import SGLangOptions

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


# -- the registry --------------------------------------------------------------------------------


def test_engines_are_found_by_name() -> None:
    assert load_engine("embedded") is EMBEDDED
    sglang = load_engine("sglang")
    assert sglang.name == "sglang" and sglang.options_type is SGLangOptions
    assert sglang.runs_servers(SGLangOptions()) is True
    assert sglang.runs_servers(SGLangOptions(urls=("http://10.0.0.1:30000",))) is False
    assert EMBEDDED.runs_servers(NoOptions()) is False


def test_unknown_engine_lists_the_known_ones() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown rollout engine 'vllm'; known: "):
        load_engine("vllm")
    problems = _problems([*TRAIN, "--rollout-engine", "vllm"])
    assert problems == [
        "rollout.engine (--rollout-engine): unknown rollout engine 'vllm' "
        "(use one of: embedded, sglang)"
    ]


def test_missing_engine_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        KNOWN_ENGINES, "nowhere", ("rlcore_nowhere.kind", "KIND", "rlcore[nowhere]")
    )
    with pytest.raises(BackendUnavailableError, match=r"pip install 'rlcore\[nowhere\]'"):
        load_engine("nowhere")
    (problem,) = _problems([*TRAIN, "--rollout-engine", "nowhere"])
    assert problem.startswith("rollout.engine (--rollout-engine): rollout engine 'nowhere' needs")


def test_an_engine_kind_checks_the_options_it_is_given() -> None:
    assert isinstance(load_engine("sglang").options(None), SGLangOptions)
    with pytest.raises(TypeError, match="engine 'sglang' takes SGLangOptions, got NoOptions"):
        load_engine("sglang").options(NoOptions())


# -- engine options: flags and sections ----------------------------------------------------------


def test_the_chosen_engine_gets_its_flags() -> None:
    config = load_config(
        [
            *TRAIN,
            "--rollout-engine",
            "sglang",
            "--sglang-url",
            "http://10.0.0.1:30000",
            "--sglang-url",
            "http://10.0.0.2:30000",
            "--weight-sync",
            "distributed",
            "--update-weight-buffer-size",
            "1000000",
        ]
    )
    assert config.rollout.engine_options == SGLangOptions(
        urls=("http://10.0.0.1:30000", "http://10.0.0.2:30000"),
        weight_sync="distributed",
        update_weight_buffer_size=1_000_000,
    )
    assert load_config(TRAIN).rollout.engine_options == NoOptions()


def test_a_config_file_section_sets_the_engine_and_flags_override_it(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('[rollout]\nengine = "sglang"\n[sglang]\nweight_sync = "disk"\n')
    config = load_config([*TRAIN, "--config", str(toml), "--update-weight-buffer-size", "64"])
    assert config.rollout.engine_options == SGLangOptions(
        weight_sync="disk", update_weight_buffer_size=64
    )


def test_options_of_an_engine_that_is_not_chosen_are_refused(tmp_path: Path) -> None:
    assert _problems([*TRAIN, "--weight-sync", "disk"]) == [
        "sglang: settings of the 'sglang' rollout engine, but the rollout engine is 'embedded' "
        "(add --rollout-engine sglang, or drop them)"
    ]
    toml = tmp_path / "run.toml"
    toml.write_text("[rollout]\nengine_options = 3\n")
    (problem,) = _problems([*TRAIN, "--config", str(toml)])
    assert "an engine's or backend's settings go in its own section" in problem


def test_bad_engine_options_name_their_flag() -> None:
    problems = _problems(
        [
            *TRAIN,
            "--rollout-engine",
            "sglang",
            "--update-weight-buffer-size",
            "0",
            "--sglang-url",
            "10.0.0.1:30000",
        ]
    )
    assert problems == [
        "sglang.update_weight_buffer_size (--update-weight-buffer-size): must be >= 1, got 0",
        "sglang.urls (--sglang-url): not HTTP URLs: ['10.0.0.1:30000'] (write http://HOST:PORT)",
    ]
    (problem,) = _problems([*TRAIN, "--rollout-engine", "sglang", "--weight-sync", "pigeon"])
    assert problem.startswith("sglang.weight_sync")


def test_help_lists_each_engine_under_its_name() -> None:
    text = build_parser().format_help()
    # Titled like every other group: the config-file section in brackets.
    assert "rollout engine sglang (with --rollout-engine sglang) [sglang]:" in text
    assert (
        "--update-weight-buffer-size" in text and "--weight-sync {tensor,distributed,disk}" in text
    )
    assert "--rollout-engine {embedded,sglang}" in text
    assert "placement on nodes and GPUs" in text


def test_the_parser_and_the_options_import_no_torch(tmp_path: Path) -> None:
    (tmp_path / "b").touch()
    code = (
        "import sys, json; from rlcore.config.flags import build_parser, load_config; "
        "build_parser(); "
        "load_config(['--num-rollout', '0', '--eval-prompt-data', 'a', 'b', "
        "'--rollout-engine', 'sglang']); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'ray', 'megatron', 'transformers'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert json.loads(out.stdout) == []


# -- placement flags ------------------------------------------------------------------------------


def test_placement_flags_have_slimes_names_and_meaning() -> None:
    config = load_config(
        [
            *TRAIN,
            "--advantage-estimator",
            "ppo",
            "--actor-num-nodes",
            "2",
            "--actor-num-gpus-per-node",
            "4",
            "--critic-num-gpus-per-node",
            "2",
            "--micro-batch-size",
            "1",
        ]
    )
    k = config.cluster
    assert (k.actor_ranks, k.critic_ranks) == (8, 4)  # the critic takes the actor's node count
    assert k.rollout_gpus == 1  # one engine of --rollout-num-gpus-per-engine GPUs
    colocated = load_config(
        [*TRAIN, "--rollout-engine", "sglang", "--colocate", "--actor-num-gpus-per-node", "2"]
    )
    assert colocated.cluster.rollout_gpus == 2  # the actor's GPUs


def test_plan_gives_the_critic_its_own_rank_count() -> None:
    from rlcore.loop.plan import TrainPlan, plan

    config = load_config(
        [*TRAIN, "--use-critic", "--critic-num-gpus-per-node", "2", "--micro-batch-size", "2"]
    )
    the_plan = plan(config)
    assert isinstance(the_plan, TrainPlan) and the_plan.critic is not None
    assert the_plan.critic.model.parallel.world_size == 2
    assert the_plan.actor.model.parallel.world_size == 1


def test_placement_flags_that_cannot_work_are_refused() -> None:
    assert _problems([*TRAIN, "--rollout-num-gpus", "2"]) == [
        "cluster.rollout_num_gpus (--rollout-num-gpus): the 'embedded' engine starts no servers "
        "(with these settings) (drop --rollout-num-gpus)"
    ]
    sglang = [*TRAIN, "--rollout-engine", "sglang"]
    assert _problems(
        [*sglang, "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"]
    ) == [
        "cluster.rollout_num_gpus (--rollout-num-gpus): 3 rollout GPUs do not split into engines "
        "of --rollout-num-gpus-per-engine 2 (make it a multiple)"
    ]
    assert _problems([*sglang, "--colocate", "--rollout-num-gpus", "2"]) == [
        "cluster.rollout_num_gpus (--rollout-num-gpus): --colocate puts the rollout servers on "
        "the actor's 1 GPUs, but 2 are asked for (lower --rollout-num-gpus or drop --colocate)"
    ]
    (problem,) = _problems(
        [*sglang, "--sglang-url", "http://10.0.0.1:1", "--rollout-num-gpus", "1"]
    )
    assert "the 'sglang' engine starts no servers (with these settings)" in problem
    assert _problems([*TRAIN, "--critic-num-nodes", "0", "--use-critic"]) == [
        "cluster.critic_num_nodes (--critic-num-nodes): must be >= 1, got 0"
    ]
    (problem,) = _problems(
        [
            *TRAIN,
            "--use-critic",
            "--critic-num-gpus-per-node",
            "3",
            "--tensor-model-parallel-size",
            "2",
            "--actor-num-gpus-per-node",
            "2",
            "--micro-batch-size",
            "1",
        ]
    )
    assert problem.startswith("model.tensor_model_parallel_size")
    assert "the critic's ranks: tensor parallel 2 does not divide the 3 ranks" in problem
