"""Micro-batches by a token budget vs by sample count (issue #37), on the CPU, side by side.

One Megatron Llama (random weights), two training stacks: ``padded`` cuts each global batch into
``--micro-batch-size`` samples padded to the batch's longest sequence (the default), ``budget``
by ``--max-tokens-per-gpu`` (``--use-dynamic-batch-size``: longest first, each micro-batch padded
to its own longest sequence). Two batches of 8 samples with 32-token prompts: a long-tailed one
(7 answers of 32 tokens, 1 of 512) and a uniform one (8 answers of 128). For each, seconds per
train step and per log-prob pass (``forward``), alternating padded and budget in every round;
medians over the rounds, of CPU seconds (this process's, one torch thread by default; wall
seconds beside them, which on a shared machine measure the neighbours too). Targets: budget
<= 0.4x padded on the long-tailed batch, <= 1.05x on the uniform one. The budget defaults to
what the padded micro-batch holds (8 x 544 tokens). The CPU path only (per-micro-batch padding;
no packed THD sequences).

Then the memory of one train step on the long-tailed batch at that budget, without and with
activation recompute (``--recompute-granularity``): each variant in a process of its own (so one
variant's freed memory cannot serve another), which builds the stack, runs a step (the
optimizer's state now exists), resets the kernel's peak-RSS mark (``/proc/self/clear_refs``) and
runs a second step. The step's memory is that peak less the RSS before the step: activations and
the step's other transients (logits, the loss), weights, gradients and optimizer state left out.
glibc's malloc is told to map every block over 64 KiB on its own
(``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the RSS and the peak is that of live
tensors. Target: full recompute <= 0.5x of keeping every activation. Linux only.

    python -m benchmarks.packing [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.results import Ratio, write_ratios

TARGETS = {"long-tailed": 0.4, "uniform": 1.05}
RECOMPUTE_TARGET = 0.5
RECOMPUTE: dict[str, list[str]] = {
    "none": [],
    "full uniform 1": ["full", "uniform", "1"],
    "full block all": ["full", "block", "all"],
    "selective": ["selective"],
}
"""Activation recompute variants (granularity, method, layers; ``all``: every layer)."""


def hf_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.heads,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
    }


def batches(vocab: int, prompt: int, short: int, long: int) -> dict[str, list[Any]]:
    from rlcore.samples import Generation, Prompt, Sample

    rng = random.Random(0)

    def sample(i: int, answer: int) -> Sample:
        return Sample(
            Prompt(i, "", tuple(rng.randrange(1, vocab) for _ in range(prompt))),
            Generation(tuple(rng.randrange(1, vocab) for _ in range(answer)), (-1.0,) * answer, ""),
            reward=1.0,
            group=i,
        )

    return {
        "long-tailed": [sample(i, long if i == 3 else short) for i in range(8)],
        "uniform": [sample(i, 128) for i in range(8)],
    }


def _median_seconds(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall and CPU (this process's) seconds of ``repeats`` calls of ``run``."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory_child(args: argparse.Namespace, variant: str) -> None:
    """One variant's train-step memory (module docstring), printed as JSON."""
    import torch

    from rlcore.samples import TrainBatch
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.options import MegatronOptions
    from rlcore_megatron.parallel import init_megatron

    torch.set_num_threads(args.threads)
    init_megatron(1, 1234)
    parts = RECOMPUTE[variant]
    options = MegatronOptions(
        parts[0] if parts else None,  # type: ignore[arg-type]  # a RECOMPUTE literal
        parts[1] if len(parts) > 1 else None,  # type: ignore[arg-type]  # a RECOMPUTE literal
        (args.layers if parts[2] == "all" else int(parts[2])) if len(parts) > 2 else None,
    )
    stack = MegatronBackend(hf_config(args), options).build_training_stack(
        _specs(args.max_tokens_per_gpu)[1]
    )
    samples = batches(args.vocab, 32, args.short, args.long)["long-tailed"]
    batch = TrainBatch(tuple(samples), tuple((1.0,) * len(s.response.token_ids) for s in samples))
    first = stack.train_step(batch)
    before = _rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak mark (VmHWM) := the RSS now
    second = stack.train_step(batch)
    peak = _rss_kib("VmHWM")
    print(json.dumps({"before": before, "peak": peak, "loss": [first.loss, second.loss]}))


def _memory(args: argparse.Namespace) -> list[Ratio]:
    """Each recompute variant's train-step memory, in a process of its own."""
    common = [
        f"--{name}={getattr(args, name.replace('-', '_'))}"
        for name in ("vocab", "hidden", "layers", "heads", "short", "long", "threads")
    ]
    common.append(f"--max-tokens-per-gpu={args.max_tokens_per_gpu}")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}
    step: dict[str, float] = {}
    losses: dict[str, list[float]] = {}
    for variant in RECOMPUTE:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.packing", "--memory-child", variant, *common],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        row = json.loads(out.strip().splitlines()[-1])
        step[variant] = (row["peak"] - row["before"]) / 1024
        losses[variant] = row["loss"]
    print(
        f"train-step memory (peak RSS less RSS before the step, MiB), long-tailed batch, "
        f"--max-tokens-per-gpu {args.max_tokens_per_gpu}:"
    )
    ratios = []
    for variant, mib in step.items():
        ratio = mib / step["none"]
        same = "same loss" if losses[variant] == losses["none"] else f"loss {losses[variant]}"
        print(f"  recompute {variant:15} {mib:8.1f} MiB  {ratio:.2f}x  ({same})")
        if variant == "full uniform 1":
            ratios.append(
                Ratio("packing", f"recompute {variant} step memory", ratio, RECOMPUTE_TARGET)
            )
    print(f"  target: full recompute <= {RECOMPUTE_TARGET}x")
    return ratios


def _specs(budget: int) -> tuple[Any, Any]:
    """The padded train spec (8 samples a micro-batch) and the budget one."""
    import attrs

    from rlcore.specs import LossSpec, LRSchedule, ModelSpec, OptimizerSpec, TrainSpec

    padded_spec = TrainSpec(
        model=ModelSpec("actor", None),
        optimizer=OptimizerSpec(LRSchedule(lr=1e-6, min_lr=0.0, warmup_steps=0, decay_steps=10**6)),
        loss=LossSpec(),
        global_batch_size=8,
        micro_batch_size=8,
    )
    budget_spec = attrs.evolve(
        padded_spec,
        model=attrs.evolve(padded_spec.model, log_probs_max_tokens_per_gpu=budget),
        max_tokens_per_gpu=budget,
    )
    return padded_spec, budget_spec


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    parser.add_argument("--repeats", type=int, default=2, help="steps per side per round")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--short", type=int, default=32, help="the long-tailed batch's 7 answers")
    parser.add_argument("--long", type=int, default=512, help="its 8th answer")
    parser.add_argument(
        "--max-tokens-per-gpu",
        type=int,
        default=8 * 544,
        help="the budget (default: what the padded micro-batch of 8 x 544 tokens holds)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="write the ratios here")
    parser.add_argument(
        "--memory-only", action="store_true", help="only the recompute memory (no timing)"
    )
    parser.add_argument("--memory-child", choices=tuple(RECOMPUTE), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child is not None:
        _memory_child(args, args.memory_child)
        return
    if args.memory_only:
        write_ratios(args.json, _memory(args))
        return

    import torch

    from rlcore.samples import TrainBatch
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.parallel import init_megatron

    torch.set_num_threads(args.threads)
    init_megatron(1, 1234)
    backend = MegatronBackend(hf_config=hf_config(args))
    budget = args.max_tokens_per_gpu
    padded_spec, budget_spec = _specs(budget)
    stacks = {
        "padded": backend.build_training_stack(padded_spec),
        "budget": backend.build_training_stack(budget_spec),
    }
    seconds: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for name, samples in batches(args.vocab, 32, args.short, args.long).items():
        train_batch = TrainBatch(
            tuple(samples), tuple((1.0,) * len(s.response.token_ids) for s in samples)
        )
        for stack in stacks.values():  # warm up both before timing
            stack.train_step(train_batch)
            stack.forward(samples)
        for _ in range(args.rounds):
            for side, stack in stacks.items():
                runs: dict[str, Callable[[], object]] = {
                    "train step": functools.partial(stack.train_step, train_batch),
                    "log-prob pass": functools.partial(stack.forward, samples),
                }
                for kind, run in runs.items():
                    seconds.setdefault((name, kind, side), []).append(
                        _median_seconds(run, args.repeats)
                    )
    print(
        f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.threads} "
        f"thread(s); padded: 8 samples a micro-batch; budget: --max-tokens-per-gpu {budget}; "
        f"medians of {args.rounds} alternating rounds; ratios of CPU seconds (wall beside)"
    )
    ratios = []
    for name in TARGETS:
        for kind in ("train step", "log-prob pass"):
            padded = [
                statistics.median(x) for x in zip(*seconds[(name, kind, "padded")], strict=True)
            ]
            ours = [
                statistics.median(x) for x in zip(*seconds[(name, kind, "budget")], strict=True)
            ]
            ratio, wall_ratio = ours[1] / padded[1], ours[0] / padded[0]
            print(
                f"{name:12} {kind:14} CPU s: padded {padded[1]:.4f} budget {ours[1]:.4f} "
                f"{ratio:.2f}x (target <= {TARGETS[name]:g}x); wall s: padded {padded[0]:.4f} "
                f"budget {ours[0]:.4f} {wall_ratio:.2f}x"
            )
            ratios.append(Ratio("packing", f"{name} {kind}", ratio, TARGETS[name]))
    del stacks
    write_ratios(args.json, ratios + _memory(args))


if __name__ == "__main__":
    main()
