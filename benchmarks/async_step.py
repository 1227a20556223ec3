"""Seconds per step of the off-policy schedule (``--max-staleness K``) beside the synchronous one.

The full ``rlcore_megatron`` stack as the CLI assembles it (one Megatron rank in a Ray actor, the
embedded engine in this process, weight sync after every step, GRPO), on two workloads:

- **bench-tiny** (WORKLOAD.md): 16 prompts x 8 samples, at most 8 new tokens. Training dominates.
- **rollout-heavy**: 4 prompts x 4 samples whose answers are exactly ``--heavy-tokens`` long (the
  plan's sampling parameters with ``ignore_eos``): decoding 16 rows is bound by each step's
  latency, training them is cheap, so generation takes about as long as training.

Each round runs every workload with every ``K`` in this one process, alternating the order, and
discards 2 warm-up steps. A step is the time between two trained rollouts. With ``K = 0`` the
rank and the engine take turns on all the machine's threads; with ``K >= 1`` the CLI's placement
gives each side its own (on 2 cores: one thread for the rank, one for the engine), so the two
can overlap. The overlap bound is ``max(generate, advantages + train + sync)`` of the synchronous
step: what a perfect overlap would take if each side kept all the threads it has in turns. On a
2-core machine it cannot (each side runs on one thread while they overlap), so each ``K >= 1``
also prints its own sides' times and its step against their maximum: the schedule's overhead,
apart from the cost of sharing the cores. Printed per workload: each ``K``'s median seconds per
step, its ratio to ``K = 0``, and to the bounds.

Usage::

    python -m benchmarks.async_step [--steps 20] [--rounds 3] [--staleness 0 1 2]
        [--heavy-tokens 32] [--assets DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import attrs
import torch

from benchmarks.results import Ratio, write_ratios
from benchmarks.rl_step import NEW_TOKENS, PROMPTS, SAMPLES, THREADS, _StepClock

WORKLOADS = ("bench-tiny", "rollout-heavy")
HEAVY_PROMPTS, HEAVY_SAMPLES = 4, 4


def steps_with(
    model_dir: Path,
    prompts: Path,
    steps: int,
    seed: int,
    out: Path,
    max_staleness: int,
    fixed_tokens: int | None,
    prompts_per_step: int = PROMPTS,
    samples: int = SAMPLES,
) -> tuple[list[float], list[dict[str, float]]]:
    """Seconds between consecutive trained rollouts, and each rollout's perf split."""
    from benchmarks.bench_tiny import prefix_partial
    from rlcore.config.flags import load_config
    from rlcore.launch.pieces import make_engine
    from rlcore.launch.prepare import load_run_data, load_tokenizer, placement_request
    from rlcore.launch.ray.cluster import ClusterPlacement
    from rlcore.launch.ray.stacks import RayBackend
    from rlcore.loop import run
    from rlcore.loop.plan import TrainPlan, plan
    from rlcore_megatron.kind import MegatronRuntime

    # fmt: off
    config = load_config([
        "--hf-checkpoint", str(model_dir), "--prompt-data", str(prompts), "--input-key", "prompt",
        "--label-key", "answer", "--num-rollout", str(steps),
        "--rollout-batch-size", str(prompts_per_step), "--n-samples-per-prompt", str(samples),
        "--global-batch-size", str(prompts_per_step * samples),
        "--micro-batch-size", str(prompts_per_step * samples),
        "--rollout-max-response-len", str(fixed_tokens or NEW_TOKENS),
        "--lr", "1e-4", "--seed", str(seed), "--output-dir", str(out),
        "--max-staleness", str(max_staleness),
    ])
    # fmt: on
    the_plan = plan(config)
    assert isinstance(the_plan, TrainPlan)
    if fixed_tokens is not None:
        params = attrs.evolve(the_plan.rollout_params, ignore_eos=True)
        the_plan = attrs.evolve(the_plan, rollout_params=params)
    tokenizer = load_tokenizer(config)
    data = load_run_data(config, tokenizer)
    clock = _StepClock()
    placement = ClusterPlacement.reserve(placement_request(config, the_plan))
    torch.set_num_threads(placement.driver_threads or THREADS)
    try:
        with RayBackend(MegatronRuntime(), placement) as backend:
            engine = make_engine(config, tokenizer)
            try:
                clock.ends = [time.perf_counter()]
                run(the_plan, backend, engine, prefix_partial, data, clock)
            finally:
                engine.close()
    finally:
        placement.close()
        torch.set_num_threads(THREADS)
    times = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
    return times, clock.perf


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--assets", type=Path, default=None, help="a bench-tiny build")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--heavy-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="write the ratios here")
    args = parser.parse_args()
    if 0 not in args.staleness:
        parser.error("--staleness must include 0: the ratios are to the synchronous step")

    import ray

    tmp = Path(tempfile.mkdtemp(prefix="async_step_"))
    warm = 2
    runs: dict[tuple[str, int], list[float]] = {}
    splits: dict[str, list[dict[str, float]]] = {}
    try:
        if args.assets is None:
            from benchmarks.bench_tiny import build_assets

            args.assets = build_assets(tmp / "assets")
        ray.init(address="local", num_cpus=THREADS, include_dashboard=False, log_to_driver=False)
        model_dir = tmp / "model"
        shutil.copytree(args.assets / "model", model_dir)
        for f in (args.assets / "tokenizer").iterdir():
            shutil.copy(f, model_dir / f.name)
        for r in range(args.rounds):
            order = args.staleness if r % 2 == 0 else list(reversed(args.staleness))
            for workload in WORKLOADS:
                heavy = workload == "rollout-heavy"
                for k in order:
                    times, perf = steps_with(
                        model_dir,
                        args.assets / "prompts.jsonl",
                        warm + args.steps,
                        r,
                        tmp / f"{workload}-{k}-{r}",
                        k,
                        args.heavy_tokens if heavy else None,
                        *((HEAVY_PROMPTS, HEAVY_SAMPLES) if heavy else (PROMPTS, SAMPLES)),
                    )
                    runs.setdefault((workload, k), []).append(_median(times[warm:]))
                    splits.setdefault(f"{workload}:{k}", []).extend(perf[warm:])
                    print(
                        f"round {r} {workload} K={k}: {_median(times[warm:]):.3f} s/step",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"async_step: {THREADS} cores "
        f"(K = 0: rank and engine take turns on both; K >= 1: one thread each), "
        f"{args.rounds} alternating rounds of {args.steps} steps, medians of per-round medians"
    )
    ratios: list[Ratio] = []
    for workload in WORKLOADS:

        def sides(k: int, workload: str = workload) -> tuple[float, float]:
            """Median seconds of a step's generation and of the rest (advantages, train, save,
            weight sync), as measured in the runs with staleness ``k``."""
            split = splits[f"{workload}:{k}"]
            rest = ("advantages", "train", "save", "weight_sync")
            return (
                _median([p.get("perf/generate_s", 0.0) for p in split]),
                _median([sum(p.get(f"perf/{n}_s", 0.0) for n in rest) for p in split]),
            )

        generate, train = sides(0)
        bound = max(generate, train)
        sync = statistics.median(runs[workload, 0])
        tokens = (
            f"{HEAVY_PROMPTS} x {HEAVY_SAMPLES}, {args.heavy_tokens} tokens each"
            if workload == "rollout-heavy"
            else f"{PROMPTS} x {SAMPLES}, <= {NEW_TOKENS} tokens"
        )
        print(
            f"{workload} ({tokens}): synchronous split: generate {generate:.3f}, "
            f"advantages + train + save + sync {train:.3f} s; overlap bound {bound:.3f} s/step"
        )
        for k in args.staleness:
            step = statistics.median(runs[workload, k])
            own = ""
            if k:  # its own sides, each on its share of the cores, next to each other
                g, t = sides(k)
                own = f"; its sides: generate {g:.3f}, the rest {t:.3f}, {step / max(g, t):.2f}x"
            print(
                f"  K={k}: {step:.3f} s/step = {step / sync:.2f}x synchronous, "
                f"{step / bound:.2f}x the bound{own} (rounds: "
                + ", ".join(f"{t:.3f}" for t in runs[workload, k])
                + ")"
            )
            if k == 1 and workload == "rollout-heavy":
                ratios.append(
                    Ratio("async_step", "K=1 vs synchronous, rollout-heavy", step / sync, 0.70)
                )
                ratios.append(
                    Ratio(
                        "async_step", "K=1 vs the overlap bound, rollout-heavy", step / bound, 1.15
                    )
                )
    write_ratios(args.json, ratios)


if __name__ == "__main__":
    main()
