"""bench-tiny's train step alone, in this process: rlcore's Megatron stack (``train_step``)
against the plain-PyTorch floor's train part (the forward, loss, backward, clip and fused AdamW of
:func:`benchmarks.rl_step.floor_steps`) on the same batch, alternating, in CPU seconds of this
process (no Ray, no generation: where :mod:`benchmarks.rl_step`'s train time goes, issue #38).

The batch: bench-tiny's first 16 prompts x 8 samples, each with 8 random response tokens and a
random advantage (the workload's shapes: 128 sequences of 15 tokens). ``--profile`` also prints
torch's per-operator CPU time of each, the least over the measured steps, side by side.

Usage::

    python -m benchmarks.train_step [--assets DIR] [--steps 10] [--rounds 3] [--profile]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from benchmarks.rl_step import NEW_TOKENS, PROMPTS, SAMPLES, THREADS

if TYPE_CHECKING:
    from rlcore.protocols.stacks import TrainingStack

Step = Callable[[], object]


def _ours(
    model_dir: Path, prompts: Path, backends: list[str], bf16: bool = False
) -> tuple[dict[str, Step], torch.Tensor, torch.Tensor]:
    """rlcore's step of each of ``backends`` on the batch; the batch's tokens ``[B, S]`` and
    response positions."""
    from rlcore.algorithms.batching import tensorize
    from rlcore.config.flags import load_config
    from rlcore.launch.prepare import load_tokenizer
    from rlcore.loop.plan import TrainPlan, plan
    from rlcore.samples import Generation, Prompt, Sample, TrainBatch

    flags = ["--hf-checkpoint", str(model_dir), "--prompt-data", str(prompts)]
    flags += ["--input-key", "prompt", "--label-key", "answer", "--num-rollout", "1"]
    flags += ["--rollout-batch-size", str(PROMPTS), "--n-samples-per-prompt", str(SAMPLES)]
    flags += ["--global-batch-size", str(PROMPTS * SAMPLES)]
    flags += ["--micro-batch-size", str(PROMPTS * SAMPLES)]
    flags += ["--rollout-max-response-len", str(NEW_TOKENS), "--lr", "1e-4", "--clip-grad", "1"]
    flags += ["--bf16"] if bf16 else []
    config = load_config(flags)
    planned = plan(config)
    assert isinstance(planned, TrainPlan)
    tok = load_tokenizer(config)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()][:PROMPTS]
    gen = torch.Generator().manual_seed(0)
    samples, advantages = [], []
    for i in range(PROMPTS * SAMPLES):
        row = rows[i // SAMPLES]
        ids = tuple(int(t) for t in tok.encode(row["prompt"]))
        response = tuple(int(t) for t in torch.randint(3, 16, (NEW_TOKENS,), generator=gen))
        samples.append(
            Sample(
                Prompt(i // SAMPLES, row["prompt"], ids, row["answer"]),
                Generation(response, (0.0,) * NEW_TOKENS, ""),
                0.0,
                i // SAMPLES,
            )
        )
        advantages.append((float(torch.randn(1, generator=gen)),) * NEW_TOKENS)
    batch = TrainBatch(tuple(samples), tuple(advantages))
    steps: dict[str, Step] = {}
    for backend in backends:
        if backend == "megatron":
            from rlcore_megatron.backend import MegatronBackend

            stack: TrainingStack = MegatronBackend().build_training_stack(planned.actor)
        else:
            from rlcore_fsdp.backend import FSDPBackend

            stack = FSDPBackend().build_training_stack(planned.actor)
        steps[f"rlcore {backend}"] = functools.partial(stack.train_step, batch)
    tb = tensorize(batch, 0)
    return steps, tb.tokens, tb.response_index


def _floor(model_dir: Path, tokens: torch.Tensor, index: torch.Tensor) -> Step:
    """The floor's train part (:func:`benchmarks.rl_step.floor_steps`) on ``tokens``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    assert bool((index[:, 0] == index[0, 0]).all()), "bench-tiny's prompts are of one length"
    completion = tokens.gather(1, index + 1)
    mask = torch.ones_like(completion, dtype=torch.bool)
    adv = torch.randn(tokens.shape[0], generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(tokens)

    def step() -> None:
        model.train()
        logits = model(input_ids=tokens, attention_mask=attn).logits[:, index[0, 0] : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, completion[..., None])[..., 0]
        per_tok = -torch.exp(logp - logp.detach()) * adv[:, None]
        loss = ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        opt.zero_grad()
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def _operators(step: Step, steps: int) -> dict[str, float]:
    """Each operator's self CPU milliseconds in one step, the least over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    least: dict[str, float] = {}
    for i in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        seen = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
        least = seen if i == 0 else {k: min(v, seen[k]) for k, v in least.items() if k in seen}
    return least


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--assets", type=Path, default=None, help="a bench-tiny build")
    parser.add_argument("--steps", type=int, default=10, help="measured steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="per-operator CPU time too")
    parser.add_argument("--top", type=int, default=30, help="operators --profile shows")
    parser.add_argument(
        "--backends",
        nargs="+",
        choices=("megatron", "fsdp"),
        default=["megatron"],
        help="rlcore's training backends to time (each against the floor)",
    )
    parser.add_argument("--bf16", action="store_true", help="rlcore's stacks in bf16")
    parser.add_argument(
        "--threads",
        type=int,
        default=THREADS,
        help="torch's threads; 1 for --profile, whose times are the main thread's",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="train_step_"))
    try:
        if args.assets is None:
            from benchmarks.bench_tiny import build_assets

            args.assets = build_assets(tmp / "assets")
        model_dir = tmp / "model"  # weights and tokenizer together, as the CLI expects
        shutil.copytree(args.assets / "model", model_dir)
        for f in (args.assets / "tokenizer").iterdir():
            shutil.copy(f, model_dir / f.name)
        ours, tokens, index = _ours(
            model_dir, args.assets / "prompts.jsonl", args.backends, args.bf16
        )
        steps = {**ours, "floor": _floor(model_dir, tokens, index)}
        medians: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():  # warm-up
            step()
            step()
        for _ in range(args.rounds):
            for name, step in steps.items():
                times = []
                for _ in range(args.steps):
                    start = time.process_time()
                    step()
                    times.append(time.process_time() - start)
                medians[name].append(statistics.median(times))
        result = {name: statistics.median(m) for name, m in medians.items()}
        floor_s = result["floor"]
        shown = ", ".join(f"{name} {s:.4f} ({s / floor_s:.3f}x)" for name, s in result.items())
        print(
            f"bench-tiny train step ({tuple(tokens.shape)} tokens), {args.threads} threads, "
            f"{'bf16' if args.bf16 else 'fp32'} (the floor fp32), {args.rounds} alternating "
            f"rounds of {args.steps}, CPU s of this process: {shown} "
            f"(per-round medians {medians})"
        )
        if args.profile:
            ops = {name: _operators(step, args.steps) for name, step in steps.items()}
            first = next(iter(ops.values()))
            header = "".join(f"{name.removeprefix('rlcore '):>10}" for name in ops)
            print(f"{'operator (self CPU ms per step, least)':<58}{header}")
            every = set().union(*ops.values())
            for key in sorted(every, key=lambda k: -first.get(k, 0.0))[: args.top]:
                row = "".join(f"{o.get(key, 0.0):10.2f}" for o in ops.values())
                print(f"{key[:58]:<58}{row}")
            totals = "".join(f"{sum(o.values()):10.2f}" for o in ops.values())
            print(f"{'all operators':<58}{totals}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
