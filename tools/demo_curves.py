"""Learning curves of the demo over seeds and variants: the README's tables come from here.

    PYTHONPATH=src:. python tools/demo_curves.py [--seeds 0 1 2] [--variant NAME=FLAGS ...]
        [--work runs/curves] [--plot curves.png]

Runs ``python -m rlcore_megatron.run`` on the no-flag demo (``runs/demo``'s model and data, built
by :func:`rlcore_megatron.demo.prepare_demo`), once per variant and seed, each in its own process
as a user runs it, with ``--seed S`` (sampling and the prompt order; the model's initial weights
are the demo's). A variant is a name and extra flags: ``--variant k1="--max-staleness 1"``;
without ``--variant``: the synchronous demo only. Prints, per variant, the held-out greedy
accuracy at every evaluation as the median over seeds with the min-max range, and per seed the
first evaluation at or above 0.9 and 0.95; ``--plot`` draws every run's curves
(:mod:`rlcore.plot`). It also says which torch build it ran on.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rlcore.loop.metrics import read_jsonl_metrics
from rlcore.plot import plot
from rlcore_megatron.demo import demo_flags, prepare_demo

HELD_OUT = "eval/heldout/reward"


def _flags(demo: Path, out: Path, seed: int, extra: list[str]) -> list[str]:
    flags = demo_flags(demo)
    for flag, value in (("--save", out / "ckpt"), ("--output-dir", out / "run"), ("--seed", seed)):
        flags[flags.index(flag) + 1] = str(value)
    return [*flags, *extra]


def _first(points: list[tuple[int, float]], threshold: float) -> str:
    return next((str(step) for step, value in points if value >= threshold), "never")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variant", action="append", default=None, metavar="NAME=FLAGS")
    parser.add_argument("--work", type=Path, default=Path("runs/curves"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    variants = dict(v.split("=", 1) for v in (args.variant or ["sync="]))
    import torch

    demo = args.work / "demo"
    prepare_demo(demo)
    runs: dict[str, list[dict[str, float]]] = {}
    curves: dict[str, list[list[tuple[int, float]]]] = {name: [] for name in variants}
    for name, extra in variants.items():
        for seed in args.seeds:
            out = args.work / f"{name}-seed{seed}"
            t0 = time.perf_counter()
            flags = _flags(demo, out, seed, shlex.split(extra))
            done = subprocess.run(
                [sys.executable, "-m", "rlcore_megatron.run", *flags],
                capture_output=True,
                text=True,
            )
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            rows = read_jsonl_metrics(out / "run" / "metrics.jsonl")
            runs[f"{name} seed {seed}"] = rows
            curves[name].append([(int(r["step"]), r[HELD_OUT]) for r in rows if HELD_OUT in r])
            print(
                f"{name} seed {seed}: {time.perf_counter() - t0:.0f} s, held-out "
                + " ".join(f"{v:.2f}" for _, v in curves[name][-1]),
                file=sys.stderr,
                flush=True,
            )
    print(f"torch {torch.__version__}, seeds {args.seeds}; held-out greedy exact match")
    steps = [step for step, _ in curves[next(iter(variants))][0]]
    print("| variant | " + " | ".join(str(s) for s in steps) + " | first >= 0.9 | first >= 0.95 |")
    print("|---" * (len(steps) + 3) + "|")
    for name, per_seed in curves.items():
        cells = []
        for i in range(len(steps)):
            values = [points[i][1] for points in per_seed]
            cells.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        first = [", ".join(_first(points, t) for points in per_seed) for t in (0.9, 0.95)]
        print(f"| {name} | " + " | ".join(cells) + f" | {first[0]} | {first[1]} |")
    if args.plot is not None:
        plot(runs, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
