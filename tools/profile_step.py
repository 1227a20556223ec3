"""Where bench-tiny's rlcore step spends its time: cProfile in the driver and in the rank.

Runs ``benchmarks.rl_step``'s rlcore side (fp32, or ``--bf16``) for ``--steps`` steps after 2
warm-up steps, profiling the driver (the loop, generation, the weight sync's driver half) and
the Megatron rank (the train step, the weight export) over the same steps, and prints the top
of each by cumulative time; ``--out DIR`` keeps the two ``.prof`` files for ``python -m pstats``
or snakeviz. cProfile inflates Python-heavy code and can misplace time inside C calls that run
OpenMP threads (the optimizer's fused kernels): read wall-clock splits from ``rl_step`` itself.

    PYTHONPATH=src:. python tools/profile_step.py [--steps 20] [--bf16] [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

import benchmarks.rl_step as rl_step

WARM = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="keep driver.prof and rank.prof")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(rl_step.THREADS)

    import ray

    from benchmarks.bench_tiny import build_assets
    from rlcore.launch.ray import stacks

    tmp = Path(tempfile.mkdtemp(prefix="profile_step_"))
    out = args.out or tmp
    out.mkdir(parents=True, exist_ok=True)
    driver = cProfile.Profile()
    train_step = stacks.train_step
    calls = [0]

    def start(context: Any) -> None:  # in the rank (pickled by value: a nested function)
        import cProfile

        context.stack.profile = cProfile.Profile()
        context.stack.profile.enable()

    def stop(context: Any, path: str) -> None:
        context.stack.profile.disable()
        context.stack.profile.dump_stats(path)

    def profiled_train_step(group: Any, batch: Any) -> Any:
        # Train steps run one per rollout: profile from the first measured one to the last.
        calls[0] += 1
        if calls[0] == WARM + 1:
            group.run_on_all_ranks(start)
            driver.enable()
        metrics = train_step(group, batch)
        if calls[0] == WARM + args.steps:
            group.run_on_all_ranks(stop, str(out / "rank.prof"))
        return metrics

    stacks.train_step = profiled_train_step
    try:
        assets = build_assets(tmp / "assets")
        ray.init(
            address="local", num_cpus=rl_step.THREADS, include_dashboard=False, log_to_driver=False
        )
        model_dir = tmp / "model"
        shutil.copytree(assets / "model", model_dir)
        for f in (assets / "tokenizer").iterdir():
            shutil.copy(f, model_dir / f.name)
        times, perf = rl_step.rlcore_steps(
            model_dir, assets / "prompts.jsonl", WARM + args.steps, 0, tmp / "run", args.bf16
        )
        driver.disable()
        driver.dump_stats(str(out / "driver.prof"))
    finally:
        stacks.train_step = train_step
        if ray.is_initialized():
            ray.shutdown()
    print(f"median s/step {statistics.median(times[WARM:]):.3f} (profiled)")
    for key in sorted(perf[0]):
        print(f"  {key} {statistics.median(p[key] for p in perf[WARM:]):.4f}")
    for name in ("driver", "rank"):
        print(f"\n--- {name}, by cumulative time ---")
        pstats.Stats(str(out / f"{name}.prof")).sort_stats("cumulative").print_stats(args.top)
    if args.out is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
