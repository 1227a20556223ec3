"""Learning curves of the demos over seeds and variants: the README's tables come from here.

    PYTHONPATH=src:. python tools/demo_curves.py [--demo reverse|tool|opd|own-task] [--seeds 0 1 2]
        [--variant NAME=FLAGS ...] [--work runs/curves] [--plot curves.png]

``--demo reverse`` (default) runs ``python -m rlcore_megatron.run`` on the no-flag demo
(``runs/demo``'s model and data, built by :func:`rlcore.launch.demo.prepare_demo`); ``--demo
tool`` runs the tool demo's two phases (:func:`rlcore.launch.tool_demo.tool_demo_flags`: the
warm start, then GRPO from its checkpoint) and an eval-only run of the result with a calculator
that refuses every call; ``--demo opd`` trains the teacher once (the reverse demo as shipped,
seed 0) and then the fresh model from it by on-policy distillation with no warm start
(:func:`rlcore.launch.demo.opd_demo_flags`; a variant ``pure=--opd-only`` drops the reward);
``--demo own-task`` runs the README's "Your own task" section as written (``tests/readme_task.py``):
its steps before training once, then its training command with the run's folders under the work
folder (its table is of exact answers, ``eval/heldout/pass@1``).
Each run is its own process, as a user runs it, with ``--seed S``
(sampling and the prompt order; the model's initial weights and the data are the demo's). A
variant is a name and extra flags (for the tool demo: for its GRPO phase): ``--variant
k1="--max-staleness 1"``; without ``--variant``, the demo as it ships.

Prints, per variant, the held-out greedy accuracy at every evaluation as the median over seeds
with the min-max range (the tool demo's GRPO evaluations at the warm start's rollouts plus their
own), and per seed the first evaluation at or above 0.9 and 0.95; ``--plot`` draws every run's
curves (:mod:`rlcore.plot`). It also says which torch build it ran on.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs

from rlcore.launch.demo import demo_flags, opd_demo_flags, prepare_demo
from rlcore.launch.tool_demo import (
    WARM_START_ROLLOUTS,
    prepare_tool_demo,
    tool_demo_eval_flags,
    tool_demo_flags,
)
from rlcore.loop.metrics import read_jsonl_metrics
from rlcore.plot import plot

HELD_OUT = "eval/heldout/reward"
EXACT = "eval/heldout/pass@1"
NO_TOOL = "eval/no_calculator/reward"
Rows = list[dict[str, float]]


def _run(flags: Sequence[str], metrics: Path) -> Rows:
    done = subprocess.run(
        [sys.executable, "-m", "rlcore_megatron.run", *flags], capture_output=True, text=True
    )
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(done.returncode)
    return read_jsonl_metrics(metrics)


def _placed(flags: list[str], out: Path, seed: int, extra: list[str]) -> Rows:
    """Run a demo's ``flags`` with its checkpoints and metrics under ``out``, and ``seed``."""
    for flag, value in (("--save", out / "ckpt"), ("--output-dir", out / "run"), ("--seed", seed)):
        flags[flags.index(flag) + 1] = str(value)
    return _run([*flags, *extra], out / "run" / "metrics.jsonl")


def _reverse(demo: Path, out: Path, seed: int, extra: list[str]) -> Rows:
    return _placed(demo_flags(demo), out, seed, extra)


def _opd(demo: Path, out: Path, seed: int, extra: list[str]) -> Rows:
    """The student; the teacher (the shipped demo, seed 0) is trained by the first call."""
    teacher = out.parent / "teacher"
    if not (teacher / "ckpt" / "latest").exists():
        _reverse(demo, teacher, 0, [])
    return _placed(opd_demo_flags(demo, teacher / "ckpt"), out, seed, extra)


def _tool(demo: Path, out: Path, seed: int, extra: list[str]) -> Rows:
    """Both phases as one curve (GRPO's rollouts numbered after the warm start's), and the last
    row with ``eval/no_calculator/reward``: the final checkpoint when every call fails."""
    warm = _run(tool_demo_flags(demo, "warm", seed=seed, out=out), out / "run_warm/metrics.jsonl")
    grpo = _run(
        [*tool_demo_flags(demo, "grpo", seed=seed, out=out), *extra],
        out / "run_grpo" / "metrics.jsonl",
    )
    alone = _run(
        tool_demo_eval_flags(demo, "no_calculator", out=out),
        out / "eval_no_calculator" / "metrics.jsonl",
    )
    # (GRPO's evaluation before training is the warm start's last one: same weights, greedy)
    shifted = [
        {**row, "step": row["step"] + WARM_START_ROLLOUTS}
        for row in grpo
        if row["step"] > 0 or HELD_OUT not in row
    ]
    last = {"step": shifted[-1]["step"], NO_TOOL: alone[-1][HELD_OUT]}
    return [*warm, *shifted, last]


def _prepare_own_task(folder: Path) -> None:
    """The README's steps before its training command, once, in ``folder``."""
    from tests.readme_task import run, steps, train_step

    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "sort" / "train.jsonl").is_file():
        return
    all_steps = steps()
    for step in all_steps[: all_steps.index(train_step(all_steps))]:
        run(step, folder, timeout_s=600)


def _own_task(demo: Path, out: Path, seed: int, extra: list[str]) -> Rows:
    """The README's training command, in ``demo`` (its model, data and reward module), with
    ``--seed`` and the run's checkpoints, exports and metrics under ``out``."""
    from tests.readme_task import run, steps, train_step

    step = train_step(steps())
    out = out.resolve()
    placed = [
        *("--seed", str(seed), "--output-dir", str(out / "run"), "--save", str(out / "ckpt")),
        *("--overwrite-save", "--save-hf", str(out / "export"), *extra),
    ]
    run(attrs.evolve(step, code=step.code.rstrip() + " " + shlex.join(placed)), demo, 7200)
    return read_jsonl_metrics(out / "run" / "metrics.jsonl")


def _first(points: list[tuple[int, float]], threshold: float) -> str:
    return next((str(step) for step, value in points if value >= threshold), "never")


def _cell(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(curves: Mapping[str, list[list[tuple[int, float]]]], extra: Mapping[str, str]) -> str:
    """The Markdown table: per variant, the median (min-max) at each evaluation and the first
    evaluation at or above 0.9 and 0.95 per seed; ``extra`` adds a last column per variant."""
    steps = [step for step, _ in next(iter(curves.values()))[0]]
    tail = " | first >= 0.9 | first >= 0.95 |" + (" without the tool |" if extra else "")
    lines = ["| variant | " + " | ".join(str(s) for s in steps) + tail]
    lines.append("|---" * (len(steps) + 3 + bool(extra)) + "|")
    for name, per_seed in curves.items():
        cells = [_cell([points[i][1] for points in per_seed]) for i in range(len(steps))]
        first = [", ".join(_first(points, t) for points in per_seed) for t in (0.9, 0.95)]
        row = f"| {name} | " + " | ".join(cells) + f" | {first[0]} | {first[1]} |"
        lines.append(row + (f" {extra[name]} |" if extra else ""))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--demo", choices=("reverse", "tool", "opd", "own-task"), default="reverse")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", action="append", default=None, metavar="NAME=FLAGS")
    parser.add_argument("--work", type=Path, default=Path("runs/curves"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in (args.variant or ["as shipped="]))
    import torch

    demo = args.work / ("own-task" if args.demo == "own-task" else "demo")
    prepare = {"tool": prepare_tool_demo, "own-task": _prepare_own_task}
    prepare.get(args.demo, prepare_demo)(demo)
    one_run = {"reverse": _reverse, "tool": _tool, "opd": _opd, "own-task": _own_task}[args.demo]
    metric = EXACT if args.demo == "own-task" else HELD_OUT
    runs: dict[str, Rows] = {}
    curves: dict[str, list[list[tuple[int, float]]]] = {name: [] for name in variants}
    alone: dict[str, list[float]] = {name: [] for name in variants}
    for name, extra in variants.items():
        for seed in args.seeds:
            t0 = time.perf_counter()
            rows = one_run(demo, args.work / f"{name}-seed{seed}", seed, shlex.split(extra))
            runs[f"{name} seed {seed}"] = rows
            curves[name].append([(int(r["step"]), r[metric]) for r in rows if metric in r])
            alone[name] += [r[NO_TOOL] for r in rows if NO_TOOL in r]
            print(
                f"{name} seed {seed}: {time.perf_counter() - t0:.0f} s, held-out "
                + " ".join(f"{v:.2f}" for _, v in curves[name][-1]),
                file=sys.stderr,
                flush=True,
            )
    print(f"torch {torch.__version__}, seeds {args.seeds}; held-out greedy exact match ({metric})")
    print(table(curves, {n: _cell(v) for n, v in alone.items() if v}))
    if args.plot is not None:
        plot(runs, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
