"""``--train-backend fsdp`` as the launcher finds it: registered by name with its one option,
refusing before start what it cannot do (a split other than data parallel, a folder that
transformers cannot build as a causal LM), and naming the folder when a rank cannot read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.backends import load_backend_kind
from rlcore.config.kinds import CHOICES
from rlcore.errors import BackendUnavailableError, ConfigError
from rlcore.specs import EvalSpec, ModelSpec, ParallelSpec
from rlcore_fsdp.backend import FSDPBackend, init_rank
from rlcore_fsdp.kind import FSDP, FSDPRuntime
from rlcore_fsdp.options import FSDPOptions


def test_the_kind_is_found_by_name_with_its_option() -> None:
    assert load_backend_kind("fsdp") is FSDP
    backend_choice = next(c for c in CHOICES if c.flag == "--train-backend")
    assert backend_choice.options_types()["fsdp"] is FSDPOptions
    runtime = FSDP.rank_runtime(FSDPOptions(trust_remote_code=True))
    assert runtime == FSDPRuntime(FSDPOptions(trust_remote_code=True))


def test_only_data_parallel_splits_are_made() -> None:
    assert FSDP.parallel_problem(ParallelSpec(world_size=4)) is None
    for split in (ParallelSpec(tensor=2, world_size=2), ParallelSpec(pipeline=2, world_size=2)):
        problem = FSDP.parallel_problem(split)
        assert problem is not None and "--train-backend megatron" in problem
    with pytest.raises(BackendUnavailableError, match="expert parallel 2"):
        init_rank(ParallelSpec(expert=2, world_size=2), seed=0)  # a rank refuses it too


def test_model_folders_transformers_cannot_build_as_a_causal_lm_are_refused() -> None:
    assert FSDP.model_problems({"model_type": "gpt2"}, "m/config.json") == []
    assert FSDP.model_problems({"auto_map": {"AutoModelForCausalLM": "x.Y"}}, "m") == []
    for config, says in (
        ({}, "names no model_type"),
        ({"model_type": "no-such-model"}, "does not know model_type 'no-such-model'"),
        ({"model_type": "clip"}, "no causal LM"),
    ):
        (problem,) = FSDP.model_problems(config, "m/config.json")
        assert problem.path == "model_type" and says in problem.message


def test_a_folder_a_rank_cannot_read_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ConfigError, match=str(tmp_path)):
        FSDPBackend().build_eval_stack(EvalSpec(ModelSpec("actor", tmp_path)))


def test_a_checkpoint_of_another_model_is_named(tmp_path: Path) -> None:
    record = {"model": {"model_type": "gpt2", "vocab_size": 40, "hidden_size": 32}}
    (tmp_path / "rollout.json").write_text(json.dumps(record))
    config = {"model_type": "gpt2", "vocab_size": 50, "n_embd": 32, "n_layer": 2}
    problem = FSDP.saved_model_problem(tmp_path, config, "m/config.json")
    assert problem is not None and "vocab_size is 40 there, 50 in the folder" in problem
