"""Bring-up cost of an eval stack vs a training stack, Megatron (or FSDP) on the CPU.

For a ~100M-parameter Llama-style model (random weights from a config), each side runs in a fresh
subprocess so that its peak RSS is its own:

- eval:  ``build_eval_stack`` + ``forward`` on one batch
- train: ``build_training_stack`` + one ``train_step`` on the same batch

Printed side by side with their ratio. Target: eval peak RSS <= 0.6 x training peak RSS (an eval
stack holds no gradient buffers, no optimizer state, no scheduler).

``--bf16`` builds both in bf16 (``ModelSpec.precision``): the eval stack holds 2 bytes per
parameter, the training stack 18 (bf16 weights, fp32 gradient buffer, fp32 main weights, two fp32
Adam moments). Target: <= 0.25 x, for what the stacks hold: the peaks above the RSS after imports
(the same Python, torch and Megatron in both, 0.4 GiB here, which at 100M bf16 parameters is
larger than the whole eval stack). The ratio of the whole peaks is printed beside it.

``--train-backend fsdp`` measures the FSDP backend instead, in this process as one rank (no Ray:
the process measured is the one that holds the model), from a Hugging Face folder of the same
model that this script writes first (random weights, :func:`rlcore.new_model.build_model`). Its
fp32 target is <= 0.45 x (issue #36).

``--lora-rank N`` (fsdp only) compares two training stacks instead: with LoRA adapters of rank
``N`` on every linear layer against full fine-tuning, the same train steps on the same batch.
Target: LoRA's peak RSS <= 0.5 x full fine-tuning's (issue #36): a run's peak, so each side takes
``--steps`` train steps (3 by default here, 1 for the bring-up comparisons). The first step is no
run's peak: AdamW makes its moments in that step's update, after the backward, and every later
backward runs beside them (full fine-tuning: two fp32 copies of the weights more).

    python -m benchmarks.bringup [--layers 12] [--hidden 768] [--batch 4] [--seq 128] [--bf16]
        [--train-backend {megatron,fsdp}] [--lora-rank N] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.results import Ratio, write_ratios

TARGET_RSS_RATIO = {"float32": 0.6, "bfloat16": 0.25}
"""Megatron's eval/train targets; ``--train-backend fsdp``'s are :data:`FSDP_TARGET_RSS_RATIO`."""
FSDP_TARGET_RSS_RATIO = {"float32": 0.45, "bfloat16": 0.25}
LORA_TARGET_RSS_RATIO = 0.5
"""LoRA's training peak RSS over full fine-tuning's, at most (issue #36)."""


def hf_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.ffn,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": 2 * args.seq,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
    }


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def write_hf_folder(folder: Path, args: argparse.Namespace) -> None:
    """The model of :func:`hf_config` as a Hugging Face folder (random fp32 weights), what the
    fsdp backend builds from."""
    from rlcore.new_model import Sizes, build_model

    sizes = Sizes(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.ffn,
        max_position_embeddings=2 * args.seq,
    )
    build_model(folder, vocab_size=args.vocab, sizes=sizes, tie_word_embeddings=True)


def _backend(side: str, args: argparse.Namespace) -> Any:
    """The backend the child measures, for this process as its one rank."""
    if args.train_backend == "fsdp":
        from rlcore_fsdp.backend import FSDPBackend
        from rlcore_fsdp.options import FSDPOptions

        return FSDPBackend(
            FSDPOptions(
                lora_rank=args.lora_rank if side == "lora" else 0,
                gradient_checkpointing=args.gradient_checkpointing,
            )
        )
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.parallel import init_megatron

    init_megatron(1, 1234)
    return MegatronBackend(hf_config=hf_config(args))


def child(side: str, args: argparse.Namespace) -> dict[str, float]:
    import random

    import torch

    from rlcore.samples import Generation, Prompt, Sample, TrainBatch
    from rlcore.specs import EvalSpec, LossSpec, LRSchedule, ModelSpec, OptimizerSpec, TrainSpec

    rng = random.Random(0)
    half = args.seq // 2
    samples = [
        Sample(
            Prompt(i, "", tuple(rng.randrange(1, args.vocab) for _ in range(half))),
            Generation(
                tuple(rng.randrange(1, args.vocab) for _ in range(half)), (-1.0,) * half, ""
            ),
            reward=1.0,
            group=i,
        )
        for i in range(args.batch)
    ]
    backend = _backend(side, args)
    baseline = _peak_rss_mib()
    model = ModelSpec("actor", args.model_dir, precision="bfloat16" if args.bf16 else "float32")
    start = time.perf_counter()
    if side == "eval":
        stack = backend.build_eval_stack(EvalSpec(model))
        built = time.perf_counter()
        stack.forward(samples)
        params = sum(p.numel() for p in stack.model.parameters())
        trained = 0
    else:
        spec = TrainSpec(
            model=model,
            optimizer=OptimizerSpec(
                LRSchedule(lr=1e-5, min_lr=1e-6, warmup_steps=0, decay_steps=10)
            ),
            loss=LossSpec(),
            global_batch_size=args.batch,
            micro_batch_size=args.batch,
        )
        training = backend.build_training_stack(spec)
        built = time.perf_counter()
        advantages = tuple((1.0,) * half for _ in samples)
        for _ in range(args.steps):
            training.train_step(TrainBatch(tuple(samples), advantages))
        module = training.model if args.train_backend == "fsdp" else training.gpt
        params = sum(p.numel() for p in module.parameters())
        trained = sum(p.numel() for p in module.parameters() if p.requires_grad)
    done = time.perf_counter()
    return {
        "params_m": params / 1e6,
        "trained_m": trained / 1e6,
        "build_s": built - start,
        "run_s": (done - built) / (1 if side == "eval" else args.steps),
        "total_s": done - start,
        "baseline_rss_mib": baseline,
        "peak_rss_mib": _peak_rss_mib(),
        "threads": float(torch.get_num_threads()),
    }


def _measure(sides: tuple[str, str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Each side in a fresh subprocess, ``--rounds`` times alternating; per side the median of
    each figure over the rounds, and its peak RSS's min and max."""
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    extra = ["--model-dir", str(args.model_dir)] if args.model_dir is not None else []
    for _ in range(args.rounds):
        for side in sides:
            cmd = [sys.executable, "-m", "benchmarks.bringup", "--child", side]
            out = subprocess.run([*cmd, *sys.argv[1:], *extra], capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{side} subprocess failed:\n{out.stderr[-4000:]}")
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    results = {}
    for side, rows in runs.items():
        results[side] = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        results[side]["peak_min_mib"] = min(r["peak_rss_mib"] for r in rows)
        results[side]["peak_max_mib"] = max(r["peak_rss_mib"] for r in rows)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--child", choices=["build", "eval", "train", "lora"], help=argparse.SUPPRESS
    )
    parser.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--bf16", action="store_true", help="both stacks in bf16")
    parser.add_argument("--train-backend", choices=["megatron", "fsdp"], default="megatron")
    parser.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="fsdp: compare a LoRA training stack of this rank with full fine-tuning",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="fsdp: both sides recompute each decoder layer's activations in the backward",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="train steps of each training side (default: 3 with --lora-rank, else 1)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating runs of each side")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the ratio here (nox -s bench)"
    )
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 3 if args.lora_rank else 1
    if args.child == "build":
        write_hf_folder(args.model_dir, args)
        return
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    if (args.lora_rank or args.gradient_checkpointing) and args.train_backend != "fsdp":
        parser.error("--lora-rank and --gradient-checkpointing need --train-backend fsdp")

    sides = ("lora", "train") if args.lora_rank else ("eval", "train")
    with tempfile.TemporaryDirectory(prefix="bringup-") as tmp:
        if args.train_backend == "fsdp":
            # In a process of its own: a child's ru_maxrss starts at this process's peak (Linux
            # keeps it across fork and exec), so this one must never hold the model.
            args.model_dir = Path(tmp) / "model"
            cmd = [sys.executable, "-m", "benchmarks.bringup", "--child", "build", *sys.argv[1:]]
            subprocess.run([*cmd, "--model-dir", str(args.model_dir)], check=True)
        results = _measure(sides, args)

    ev, tr = results[sides[0]], results["train"]
    precision = "bfloat16" if args.bf16 else "float32"
    name = {"megatron": "Megatron", "fsdp": "FSDP"}[args.train_backend]
    print(
        f"bring-up, {name} on the CPU: {tr['params_m']:.1f}M-parameter Llama in {precision}, "
        f"batch {args.batch} x {args.seq} tokens, "
        f"{int(ev['threads'])} threads, median of {args.rounds} alternating runs each, "
        f"{args.steps} train step(s) per training stack"
        + (", gradient checkpointing on both sides" if args.gradient_checkpointing else "")
    )
    if args.lora_rank:
        print(
            f"LoRA rank {args.lora_rank} on every linear layer: "
            f"{ev['trained_m']:.2f}M trained parameters, full fine-tuning {tr['trained_m']:.1f}M"
        )
        head = ("LoRA train", "full train", "LoRA/full")
    else:
        head = ("eval stack", "training stack", "eval/train")
    print(f"{'':26}{head[0]:>14}{head[1]:>16}{head[2]:>12}")
    rows = [
        ("build (s)", "build_s"),
        ("forward / train step (s)", "run_s"),
        ("total wall (s)", "total_s"),
        ("RSS after imports (MiB)", "baseline_rss_mib"),
        ("peak RSS (MiB)", "peak_rss_mib"),
        ("peak RSS min (MiB)", "peak_min_mib"),
        ("peak RSS max (MiB)", "peak_max_mib"),
    ]
    for side in (ev, tr):
        side["held_mib"] = side["peak_rss_mib"] - side["baseline_rss_mib"]
    rows.append(("peak above imports (MiB)", "held_mib"))
    for label, key in rows:
        print(f"{label:26}{ev[key]:14.1f}{tr[key]:16.1f}{ev[key] / tr[key]:12.2f}")
    bytes_per_param = [side["held_mib"] * 2**20 / (tr["params_m"] * 1e6) for side in (ev, tr)]
    print(
        f"held per parameter: {sides[0]} {bytes_per_param[0]:.1f} bytes, "
        f"train {bytes_per_param[1]:.1f}"
    )
    ratio = ev["peak_rss_mib"] / tr["peak_rss_mib"]
    held_ratio = ev["held_mib"] / tr["held_mib"]
    bench = "bringup" if args.train_backend == "megatron" else f"bringup {args.train_backend}"
    if args.lora_rank:
        target = LORA_TARGET_RSS_RATIO
        measured, measure = ratio, f"peak RSS, LoRA vs full training, {precision}"
        verdict = "meets" if ratio <= target else "MISSES"
        print(
            f"peak RSS ratio {ratio:.2f} {verdict} the target <= {target} "
            f"(above imports {held_ratio:.2f})"
        )
    elif args.bf16:
        target = (FSDP_TARGET_RSS_RATIO if args.train_backend == "fsdp" else TARGET_RSS_RATIO)[
            precision
        ]
        measured, measure = held_ratio, "peak RSS above imports, eval vs train, bf16"
        verdict = "meets" if held_ratio <= target else "MISSES"
        print(
            f"peak RSS above imports ratio {held_ratio:.2f} {verdict} the target <= {target} "
            f"(whole peak RSS ratio {ratio:.2f})"
        )
    else:
        target = (FSDP_TARGET_RSS_RATIO if args.train_backend == "fsdp" else TARGET_RSS_RATIO)[
            precision
        ]
        measured, measure = ratio, "peak RSS, eval vs training stack"
        verdict = "meets" if ratio <= target else "MISSES"
        print(
            f"peak RSS ratio {ratio:.2f} {verdict} the target <= {target} "
            f"(above imports {held_ratio:.2f})"
        )
    write_ratios(args.json, [Ratio(bench, measure, measured, target)])


if __name__ == "__main__":
    main()
