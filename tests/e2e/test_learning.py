"""Learning-regression checks: short RL runs through ``python -m rlcore_megatron.run`` (fixed
seeds, 2 cores) that must raise held-out accuracy over their warm start by a stated margin.

The tests elsewhere check shapes and numbers; these fail when a change to the losses, the
advantages, the masks or the weight sync stops a task from learning (flipped RL advantages fail
every one of them, below). Each RL phase starts from a warm-start checkpoint with ``--finetune``,
as a user continues a supervised model with RL:

- reverse-digits (the no-flag demo's task and model): a warm start of 60 rollouts, then GRPO,
  PPO with a critic, and REINFORCE++, and GRPO again with micro-batches cut by a token budget
  (``--use-dynamic-batch-size``);
- the tool demo (multi-turn, a calculator): its shipped warm start, then a shortened GRPO phase;
- on-policy distillation (``--opd-only``) of the fresh reverse-digits model from the GRPO run's
  checkpoint, with no warm start.

Measured on torch 2.13.0+cpu, 2 cores (held-out greedy exact match at each evaluation; the runs
are deterministic: a run the day before gave GRPO the same figures; run on 2026-12-06): the
reverse-digits warm start 0.00 / 0.05 / 0.43 at rollouts 20 / 40 / 60, then after 20 / 40 / 60
RL rollouts GRPO 0.74 / 0.99 / 1.00, PPO 0.66 / 0.98 / 1.00, REINFORCE++ 0.66 / 0.92 / 1.00; the
tool demo's warm start ends at 0.23, GRPO reaches 0.98 / 1.00 after 10 / 20 rollouts;
distillation 0.02 / 0.16 / 0.42 / 0.76 / 0.93 after 60 / 100 / 120 / 140 / 160 rollouts, and
0.00 at every evaluation with the sign of its advantage flipped. With the sign of the RL
advantages flipped (the warm start untouched) every test fails: GRPO, PPO and REINFORCE++ unlearn
the task within 2-3 rollouts (no group left with differing rewards: the run stops with a
RolloutError), the tool demo falls to 0.00 (measured from a warm start of 0.51, before the
figures above were refreshed). The margin is well inside what the runs reach and well outside
what a run that does not learn reaches. About 4 min for the six
(``pytest -m learning tests/e2e/test_learning.py``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from rlcore.launch.demo import demo_flags, opd_demo_flags, prepare_demo
from rlcore.launch.tool_demo import prepare_tool_demo, tool_demo_flags
from rlcore.loop.metrics import read_jsonl_metrics

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron, pytest.mark.learning]

HELD_OUT = "eval/heldout/reward"
MARGIN = 0.3
"""The least rise in held-out accuracy over the warm start that passes."""
RL_ROLLOUTS = 60
TOOL_RL_ROLLOUTS = 20
OPD_ROLLOUTS = 160
OPD_SCORE = 0.5
"""Held-out accuracy that distillation from nothing must reach within ``OPD_ROLLOUTS``."""


def _run(flags: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "rlcore_megatron.run", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _heldout(output_dir: Path) -> list[float]:
    rows = read_jsonl_metrics(output_dir / "metrics.jsonl")
    return [row[HELD_OUT] for row in rows if HELD_OUT in row]


def _with(flags: list[str], **values: object) -> list[str]:
    """``flags`` with each ``--name`` (given as ``name``) set to its value."""
    flags = list(flags)
    for name, value in values.items():
        flags[flags.index("--" + name.replace("_", "-")) + 1] = str(value)
    return flags


@pytest.fixture(scope="module")
def reverse_warm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The reverse-digits demo's model and data, and its 60-rollout warm start alone (constant
    learning rate), saved: the RL phases' starting point. Returns the folder and the RL flags."""
    folder = tmp_path_factory.mktemp("reverse")
    prepare_demo(folder)
    flags = demo_flags(folder)
    warm = _with(
        flags, num_rollout=60, save=folder / "warm", save_interval=60, output_dir=folder / "w"
    )
    _run([*warm, "--lr-decay-style", "constant"])
    assert _heldout(folder / "w")[-1] <= 0.6  # leaves a gap for RL to close
    # From a warm start most groups score all 0 or all 1, so the demo's dynamic sampling needs
    # more rounds than its 16 to fill a batch with groups that teach something.
    rl = _with(
        flags,
        num_rollout=RL_ROLLOUTS,
        sft_warmup_rollouts=0,
        save_interval=RL_ROLLOUTS,
        dynamic_sampling_max_rounds=64,
    )
    return folder, [*rl, "--load", str(folder / "warm"), "--finetune"]


BUDGET = ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "512"]
"""A token budget (#37) that cuts the demo's global batch of 128 sequences into several
micro-batches: the RL phase must learn as it does cut by sample count."""


@pytest.fixture(scope="module")
def rl_phase(reverse_warm: tuple[Path, list[str]]) -> Callable[..., Path]:
    """Runs the RL phase from the warm start with an estimator (and ``extra`` flags), once per
    module and variant: its output folder (checkpoint in ``ckpt``). GRPO's is also the
    distillation test's teacher."""
    folder, flags = reverse_warm
    done: dict[str, Path] = {}

    def run(estimator: str, extra: tuple[str, ...] = (), name: str = "") -> Path:
        key = name or estimator
        if key not in done:
            out = folder / key
            rl = _with(flags, save=out / "ckpt", output_dir=out)
            _run([*rl, "--advantage-estimator", estimator, *extra])
            done[key] = out
        return done[key]

    return run


@pytest.mark.parametrize(
    ("estimator", "extra"),
    [
        pytest.param("grpo", (), id="grpo"),
        pytest.param("ppo", (), id="ppo"),
        pytest.param("reinforce_plus_plus", (), id="reinforce_plus_plus"),
        pytest.param("grpo", tuple(BUDGET), id="grpo-token-budget"),
    ],
)
def test_rl_raises_heldout_accuracy_over_the_warm_start(
    rl_phase: Callable[..., Path], estimator: str, extra: tuple[str, ...]
) -> None:
    name = estimator + ("-budget" if extra else "")
    curve = _heldout(rl_phase(estimator, extra, name))
    start, end = curve[0], curve[-1]
    assert end >= start + MARGIN, f"{name}: held-out {curve}"


def test_distillation_teaches_a_fresh_model_without_labels(
    reverse_warm: tuple[Path, list[str]], rl_phase: Callable[..., Path]
) -> None:
    """On-policy distillation (#25) from the GRPO run's checkpoint: the demo's fresh model, with
    no warm start and no reward (``--opd-only``), learns the task from the teacher's log-probs
    of its own samples alone."""
    folder, _ = reverse_warm
    teacher = rl_phase("grpo")
    out = folder / "opd"
    flags = opd_demo_flags(folder, teacher / "ckpt", pure=True)
    _run(_with(flags, save=out / "ckpt", output_dir=out, num_rollout=OPD_ROLLOUTS))
    curve = _heldout(out)
    assert curve[0] == 0.0 and curve[-1] >= OPD_SCORE, f"OPD: held-out {curve}"


def test_grpo_raises_the_tool_demos_heldout_accuracy_over_its_warm_start(
    tmp_path: Path,
) -> None:
    prepare_tool_demo(tmp_path)
    _run(tool_demo_flags(tmp_path, "warm"))
    warm = _heldout(tmp_path / "run_warm")
    assert warm[-1] <= 0.6, f"warm start: held-out {warm}"  # leaves a gap for RL to close
    _run(tool_demo_flags(tmp_path, "grpo", grpo=TOOL_RL_ROLLOUTS))
    curve = _heldout(tmp_path / "run_grpo")
    assert curve[0] == warm[-1]  # GRPO's step-0 eval scores the warm checkpoint it loaded
    assert curve[-1] >= curve[0] + MARGIN, f"GRPO: held-out {curve} after the warm start's {warm}"
