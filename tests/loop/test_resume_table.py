"""The README's table of what a resume does with a changed setting, row by row: each row's example
is trained and resumed (the fake backend, through :func:`rlcore.loop.run`, where the resume is
decided), and what happened must be what the row says: applied or refused, and, where the row
names a flag that makes it apply, applied with that flag."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError, PlanError
from rlcore.loop import RunData, run
from rlcore.loop.plan import plan
from rlcore.samples import Prompt
from rlcore.testing import FakeBackend, ScriptedEngine, label_reward

README = Path(__file__).resolve().parents[2] / "README.md"
HEADER = "| changed on resume | what happens |"
PROMPTS = tuple(Prompt(index=i, text=f"{i}?", token_ids=(1, i + 3), label=str(i)) for i in range(8))


@attrs.frozen
class Row:
    """A row's example: the first run's flags and rollouts, the resumed run's, what the refusal
    of a refused one says, and the flags that make it apply (none for a row that is applied, or
    always refused)."""

    first: tuple[str, ...]
    rollouts: int
    resumed: tuple[str, ...]
    resumed_rollouts: int
    refusal: str = ""
    way_out: tuple[str, ...] = ()


LINEAR = ("--lr-decay-style", "linear")
ROWS = {
    "intervals, sampling, logging, data keys (`--save-interval`, `--rollout-top-p`, ...)": Row(
        (), 2, ("--save-interval", "3", "--rollout-top-p", "0.9", "--input-key", "question"), 4
    ),
    "`--num-rollout`, with a constant learning rate": Row((), 2, (), 4),
    "`--num-rollout`, with a decaying learning rate whose length it sets (`--lr-decay-style "
    "linear` or `cosine`, no `--lr-decay-iters`)": Row(
        LINEAR, 2, LINEAR, 4, "keep decaying over 2 steps", ("--override-opt-param-scheduler",)
    ),
    "`--num-rollout`, longer than a schedule that decays to a learning rate of 0 "
    "(`--lr-decay-iters` of the first run, `--min-lr 0`)": Row(
        (*LINEAR, "--lr-decay-iters", "2"),
        2,
        (*LINEAR, "--lr-decay-iters", "2"),
        4,
        "steps 3..4 would train at a learning rate of 0",
        ("--override-opt-param-scheduler", "--lr-decay-iters", "4"),
    ),
    "`--lr` and the optimizer's other settings, `--global-batch-size`, `--n-samples-per-prompt` "
    "(what one step of the schedule means)": Row(
        (), 2, ("--lr", "5e-4"), 4, "optim.lr (--lr)", ("--override-opt-param-scheduler",)
    ),
    "`--bf16`, `--use-distributed-optimizer` (the optimizer state's form)": Row(
        (), 2, ("--bf16",), 4, "model.bf16 (--bf16)", ("--no-load-optim",)
    ),
    "`--seed` (the prompt order and sampling)": Row(
        (), 2, ("--seed", "3"), 4, "seed (--seed)", ("--no-load-rng",)
    ),
    "a critic the checkpoint has none of (`--advantage-estimator ppo` after GRPO)": Row(
        (), 2, ("--advantage-estimator", "ppo"), 4, "no critic to resume", ("--finetune",)
    ),
    "`--tensor-model-parallel-size`, `--expert-model-parallel-size`": Row(
        ("--actor-num-gpus-per-node", "2"),
        2,
        ("--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"),
        4,
        "sharded for the old size",
    ),
}


def _table() -> dict[str, str]:
    """The README's table: each row's first cell and what it says happens."""
    lines = README.read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("| "):
            break
        change, what = (cell.strip() for cell in line.strip("|").split(" | "))
        rows[change] = what
    return rows


def _flags(tmp: Path, rollouts: int, *extra: str) -> list[str]:
    return [
        *("--num-rollout", str(rollouts), "--rollout-batch-size", "2"),
        *("--n-samples-per-prompt", "2", "--global-batch-size", "4", "--micro-batch-size", "1"),
        *("--save", str(tmp / "ckpt"), "--lr", "1e-3", *extra),
    ]


def _resume(argv: list[str]) -> str | None:
    """``None`` when the run resumes and trains, else why it was refused (before anything was
    built)."""
    backend = FakeBackend()
    data = RunData(PROMPTS)
    try:
        result = run(plan(load_config(argv)), backend, ScriptedEngine(), label_reward, data)
    except (ConfigError, PlanError) as exc:
        assert backend.roles_built == []
        return str(exc)
    assert result.trained
    return None


def test_every_row_of_the_readme_table_is_run_here() -> None:
    assert list(_table()) == list(ROWS)


@pytest.mark.parametrize("change", list(ROWS), ids=range(len(ROWS)))
def test_a_resume_does_what_the_readme_table_says(change: str, tmp_path: Path) -> None:
    row, said = ROWS[change], _table()[change]
    assert _resume(_flags(tmp_path, row.rollouts, *row.first)) is None
    resumed = _flags(tmp_path, row.resumed_rollouts, *row.resumed)
    resumed += ["--load", str(tmp_path / "ckpt")]
    refused = _resume(resumed)
    assert said.startswith("refused" if refused else "applied"), said
    assert (refused is not None) == bool(row.refusal)
    if refused is not None:
        assert row.refusal in refused, refused
    if row.way_out:
        assert f"with `{row.way_out[0]}`" in said, said
        assert _resume([*resumed, *row.way_out]) is None
    else:
        assert "; with `" not in said, said
