"""The ``[algorithm]`` settings that carry an anchor's name (#34): where we give slime's or verl's
number under its name, and where we refuse its name for ours."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError

TRAIN = [
    *("--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"),
    *("--global-batch-size", "16", "--micro-batch-size", "4"),
]


def _problem(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    (problem,) = info.value.problems
    return str(problem)


def test_verls_dr_grpo_name_is_refused_for_our_other_number() -> None:
    """verl's seq-mean-token-sum-norm sums over a micro-batch's sequences; ours averages over the
    global batch's: the flag names the field and says which name gives ours."""
    problem = _problem([*TRAIN, "--loss-agg-mode", "seq-mean-token-sum-norm"])
    assert problem.startswith("algorithm.loss_agg_mode (--loss-agg-mode): seq-mean-token-sum-norm")
    assert "is verl's name" in problem and "use seq-mean-token-sum-budget" in problem
    config = load_config([*TRAIN, "--loss-agg-mode", "seq-mean-token-sum-budget"])
    assert config.algorithm.agg_mode == "seq-mean-token-sum-budget"
    other = _problem([*TRAIN, "--loss-agg-mode", "seq-sum"])
    assert "'seq-sum' is not one of seq-mean-token-mean, token-mean" in other


def test_a_config_file_with_verls_name_is_refused_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[algorithm]\nloss_agg_mode = "seq-mean-token-sum-norm"\n')
    problem = _problem([*TRAIN, "--config", str(path)])
    assert "use seq-mean-token-sum-budget" in problem


def test_dual_clip_is_off_by_default_and_its_bound_must_exceed_one() -> None:
    """slime's --eps-clip-c (verl's clip_ratio_c): None unless given; both anchors assert c > 1."""
    assert load_config(TRAIN).algorithm.eps_clip_c is None
    assert load_config([*TRAIN, "--eps-clip-c", "3"]).algorithm.eps_clip_c == 3.0
    for bad in ("1", "0.5"):
        problem = _problem([*TRAIN, "--eps-clip-c", bad])
        assert problem.startswith("algorithm.eps_clip_c (--eps-clip-c): must be > 1"), problem
        assert f"got {float(bad)}" in problem


def test_rloo_is_an_estimator_that_needs_groups() -> None:
    """--advantage-estimator rloo (verl, OpenRLHF, TRL): a leave-one-out baseline needs at least
    one other sample of the prompt, as OpenRLHF requires."""
    config = load_config([*TRAIN, "--advantage-estimator", "rloo"])
    assert config.algorithm.advantage_estimator == "rloo" and not config.algorithm.critic
    one = [*TRAIN[:4], "--n-samples-per-prompt", "1", *TRAIN[6:]]
    one[one.index("--global-batch-size") + 1] = "4"
    problem = _problem([*one, "--advantage-estimator", "rloo"])
    assert problem.startswith("rollout.n_samples_per_prompt (--n-samples-per-prompt): rloo")
