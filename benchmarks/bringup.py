"""Bring-up cost of an eval stack vs a training stack, Megatron on the CPU.

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

    python -m benchmarks.bringup [--layers 12] [--hidden 768] [--batch 4] [--seq 128] [--bf16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.results import Ratio, write_ratios

TARGET_RSS_RATIO = {"float32": 0.6, "bfloat16": 0.25}


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


def child(side: str, args: argparse.Namespace) -> dict[str, float]:
    import random

    import torch

    from rlcore.samples import Generation, Prompt, Sample, TrainBatch
    from rlcore.specs import EvalSpec, LossSpec, LRSchedule, ModelSpec, OptimizerSpec, TrainSpec
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.parallel import init_megatron

    init_megatron(1, 1234)
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
    baseline = _peak_rss_mib()
    backend = MegatronBackend(hf_config=hf_config(args))
    model = ModelSpec("actor", None, precision="bfloat16" if args.bf16 else "float32")
    start = time.perf_counter()
    if side == "eval":
        stack = backend.build_eval_stack(EvalSpec(model))
        built = time.perf_counter()
        stack.forward(samples)
        params = sum(p.numel() for p in stack.model.parameters())
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
        training.train_step(TrainBatch(tuple(samples), advantages))
        params = sum(p.numel() for p in training.gpt.parameters())
    done = time.perf_counter()
    return {
        "params_m": params / 1e6,
        "build_s": built - start,
        "run_s": done - built,
        "total_s": done - start,
        "baseline_rss_mib": baseline,
        "peak_rss_mib": _peak_rss_mib(),
        "threads": float(torch.get_num_threads()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", choices=["eval", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--bf16", action="store_true", help="both stacks in bf16")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the ratio here (nox -s bench)"
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return

    results = {}
    for side in ("eval", "train"):
        cmd = [sys.executable, "-m", "benchmarks.bringup", "--child", side] + sys.argv[1:]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{side} subprocess failed:\n{out.stderr[-4000:]}")
        results[side] = json.loads(out.stdout.strip().splitlines()[-1])

    ev, tr = results["eval"], results["train"]
    precision = "bfloat16" if args.bf16 else "float32"
    print(
        f"bring-up, Megatron on the CPU: {ev['params_m']:.1f}M-parameter Llama in {precision}, "
        f"batch {args.batch} x {args.seq} tokens, "
        f"{int(ev['threads'])} threads"
    )
    print(f"{'':26}{'eval stack':>14}{'training stack':>16}{'eval/train':>12}")
    rows = [
        ("build (s)", "build_s"),
        ("forward / train step (s)", "run_s"),
        ("total wall (s)", "total_s"),
        ("RSS after imports (MiB)", "baseline_rss_mib"),
        ("peak RSS (MiB)", "peak_rss_mib"),
    ]
    for side in (ev, tr):
        side["held_mib"] = side["peak_rss_mib"] - side["baseline_rss_mib"]
    rows.append(("peak above imports (MiB)", "held_mib"))
    for label, key in rows:
        print(f"{label:26}{ev[key]:14.1f}{tr[key]:16.1f}{ev[key] / tr[key]:12.2f}")
    bytes_per_param = [side["held_mib"] * 2**20 / (side["params_m"] * 1e6) for side in (ev, tr)]
    print(
        f"held per parameter: eval {bytes_per_param[0]:.1f} bytes, train {bytes_per_param[1]:.1f}"
    )
    ratio = ev["peak_rss_mib"] / tr["peak_rss_mib"]
    held_ratio = ev["held_mib"] / tr["held_mib"]
    target = TARGET_RSS_RATIO[precision]
    if args.bf16:
        measured, measure = held_ratio, "peak RSS above imports, eval vs train, bf16"
        verdict = "meets" if held_ratio <= target else "MISSES"
        print(
            f"peak RSS above imports ratio {held_ratio:.2f} {verdict} the target <= {target} "
            f"(whole peak RSS ratio {ratio:.2f})"
        )
    else:
        measured, measure = ratio, "peak RSS, eval vs training stack"
        verdict = "meets" if ratio <= target else "MISSES"
        print(f"peak RSS ratio {ratio:.2f} {verdict} the target <= {target}")
    write_ratios(args.json, [Ratio("bringup", measure, measured, target)])


if __name__ == "__main__":
    main()
