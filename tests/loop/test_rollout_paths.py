"""One path convention for every flag that writes or reads a file or folder per rollout
(``--save-hf``, ``--save-debug-rollout-data``, ``--load-debug-rollout-data``): slime's template,
``str.format`` with ``{rollout_id}`` (the rollout's number), or a plain folder; any other brace
is a configuration error naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlcore.checkpoint_files import rollout_path, template_problem
from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.loop.hf_export import hf_folder
from rlcore.rollout.replay import rollout_data_path

FLAGS = ("--save-hf", "--save-debug-rollout-data", "--load-debug-rollout-data")


def test_the_exports_and_the_rollout_files_share_the_template() -> None:
    for template in ("out/{rollout_id}", "out/iter_{rollout_id:04d}/hf", "out/{{x}}-{rollout_id}"):
        assert hf_folder(template, 6) == rollout_data_path(template, 6) == rollout_path(template, 6)
    # Rollout id 6 is the seventh rollout: the number is what the path carries.
    assert hf_folder("out/iter_{rollout_id:04d}/hf", 6) == Path("out/iter_0007/hf")
    assert rollout_path("out/{{x}}-{rollout_id}", 6) == Path("out/{x}-7")
    # Without braces: a folder of rollout_NNNNNN (with the files' suffix).
    assert hf_folder("out", 6) == Path("out/rollout_000007")
    assert rollout_data_path("out", 6) == Path("out/rollout_000007.json")


@given(st.text(alphabet="ab/{}_:0d", max_size=12))
def test_a_path_the_config_takes_is_one_the_run_can_use(path: str) -> None:
    if template_problem(path) is None:
        rollout_path(path, 3)  # formats: no KeyError, IndexError or ValueError at the first save


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("out/{step}", "'out/{step}' has {step}: the one field a path template takes is "),
        ("out/{}.json", "'out/{}.json' has {}: the one field a path template takes is "),
        ("out/{rollout_id", "'out/{rollout_id' has a brace that is not part of a field ("),
        ("out/{{x}}", "'out/{{x}}' has braces but no {rollout_id} field"),
        ("out/{rollout_id:q}", "cannot format a rollout's number: Unknown format code 'q'"),
    ],
)
def test_a_brace_that_is_not_the_template_is_refused_naming_the_flag(
    flag: str, path: str, said: str
) -> None:
    replay = ["--debug-train-only"] if flag == "--load-debug-rollout-data" else []
    with pytest.raises(ConfigError) as info:
        load_config(["--num-rollout", "2", flag, path, *replay])
    (problem,) = info.value.problems
    assert problem.path.endswith(f"({flag})")
    assert said in problem.message
    assert "a path with '{rollout_id}' (slime's template, str.format" in problem.hint
