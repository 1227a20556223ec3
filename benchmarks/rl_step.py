"""bench-tiny: seconds per GRPO step of the full rlcore stack vs the plain-PyTorch floor (and TRL).

The workload (bench-tiny v1): a 2.9M-parameter Llama, 16 prompts x 8 samples, 8 new tokens,
prefix partial-credit reward, GRPO without a reference model, one AdamW step per rollout, fp32,
2 threads. Its assets are built by :mod:`benchmarks.bench_tiny` (deterministically, the same bytes
as the reference build). Both are measured in this one process, alternating, each round discarding
2 warm-up steps:

- **floor**: plain PyTorch — sampled generation with a KV cache, reward, group advantages, one
  forward/backward over [prompt; completion], clip, fused AdamW.
- **rlcore**: ``rlcore.run`` with the Ray train group (one rank in a Ray actor), the embedded
  rollout engine in this process and the weight sync after every step — what
  ``python -m rlcore_megatron.run`` does; with each backend of ``--train-backend`` (default
  ``megatron``; ``--train-backend megatron fsdp`` times both in every round).
- **TRL** (``--trl``, fp32 only): TRL's ``GRPOTrainer`` configured as the workload's step
  (:mod:`benchmarks.trl_grpo`), in this process.

``--bf16`` measures both in bf16 as well, each round running all four (rlcore bf16, floor bf16,
rlcore fp32, floor fp32). In bf16 rlcore is ``--bf16``: Megatron's mixed precision (bf16 weights
and activations, fp32 main weights, gradients and Adam state) and a bf16 engine. The bf16 floor is
the same in plain PyTorch: one bf16 model generates and trains, its gradients are copied to fp32
main weights, clipped and stepped there with fused AdamW, and copied back; logits are taken in
fp32 for sampling and log-probs, as rlcore's are.

Usage::

    python -m benchmarks.rl_step [--steps 20] [--rounds 3] [--assets DIR] [--bf16]
        [--train-backend megatron fsdp] [--trl]

``--assets`` uses an existing build instead of building one in a temporary folder.

It prints the median seconds per step of each (median of the per-round medians), min and max,
the ratio against its target (fp32 <= 1.05x the floor, bf16 <= 1.0x, on an otherwise idle
machine), and where rlcore's time goes (generation, advantages, train, weight sync); with
``--bf16`` the same for bf16, and each one's bf16/fp32 ratio of seconds per step. With ``fsdp``
among the backends: fsdp's seconds per step over Megatron's (target <= 1.0x, issue #36) and, with
``--trl``, over TRL's (printed, no target).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from benchmarks.clock import Clock, TreeCPUClock, wall_clock
from benchmarks.results import Ratio, write_ratios

THREADS = 2
TARGETS = {False: 1.05, True: 1.0}
"""rlcore's seconds per step over the floor's, at most: fp32 (``False``), bf16 (``True``)."""
FSDP_VS_MEGATRON = 1.0
"""``--train-backend fsdp``'s seconds per step over Megatron's, at most (issue #36)."""
PROMPTS, SAMPLES, NEW_TOKENS = 16, 8, 8


# ------------------------------------------------------------------------------------------------
# The floor


def floor_steps(
    assets: Path, steps: int, offset: int, bf16: bool = False, clock: Clock = wall_clock
) -> list[float]:
    """Seconds per step of the plain-PyTorch GRPO step (WORKLOAD.md section 5); with ``bf16``,
    in mixed precision (bf16 model, fp32 main weights, gradients and AdamW)."""
    from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM

    from benchmarks.bench_tiny import prefix_credit  # the workload's reward, on text

    tok = AutoTokenizer.from_pretrained(str(assets / "tokenizer"))
    model = LlamaForCausalLM.from_pretrained(str(assets / "model"), dtype=torch.float32)
    rows = [json.loads(line) for line in (assets / "prompts.jsonl").read_text().splitlines()]
    params: list[torch.Tensor] = list(model.parameters())
    main = [p.detach().clone() for p in params] if bf16 else params  # what AdamW steps
    if bf16:
        model.bfloat16()
    opt = torch.optim.AdamW(
        main, lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=True
    )
    gen = torch.Generator().manual_seed(0)
    times: list[float] = []
    last = clock()
    for step in range(steps):
        batch = rows[((offset + step) * PROMPTS) % len(rows) :][:PROMPTS]
        prompt_ids = torch.tensor([tok.encode(r["prompt"]) for r in batch]).repeat_interleave(
            SAMPLES, 0
        )
        answers = [r["answer"] for r in batch for _ in range(SAMPLES)]
        n = prompt_ids.shape[0]
        model.train(False)  # nn.Module's typed spelling of eval()
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            x, done, out = prompt_ids, torch.zeros(n, dtype=torch.bool), []
            for _ in range(NEW_TOKENS):
                out_step = model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
                logits = out_step.logits[:, -1].float()
                nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
                nxt = torch.where(done, torch.zeros_like(nxt), nxt)
                out.append(nxt)
                done |= nxt == 2
                if bool(done.all()):
                    break
                x = nxt[:, None]
        completion = torch.stack(out, 1)
        eos_seen = (completion == 2).cumsum(1)
        mask = (eos_seen == 0) | ((completion == 2) & (eos_seen == 1))
        texts = [
            str(tok.decode(c[m].tolist(), skip_special_tokens=True))  # one sequence: one str
            for c, m in zip(completion, mask, strict=True)
        ]
        rewards = torch.tensor(
            [prefix_credit(t, a) for t, a in zip(texts, answers, strict=True)]
        ).view(PROMPTS, SAMPLES)
        adv = (
            (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        ).view(-1)
        model.train()
        full = torch.cat([prompt_ids, completion], 1)
        attn = torch.cat([torch.ones_like(prompt_ids), mask.long()], 1)
        logits = model(input_ids=full, attention_mask=attn).logits[:, prompt_ids.shape[1] - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, completion[..., None])[..., 0]
        per_tok = -torch.exp(logp - logp.detach()) * adv[:, None]
        loss = ((per_tok * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        opt.zero_grad()
        torch.autograd.backward(loss)
        if bf16:
            for m, p in zip(main, params, strict=True):
                m.grad, p.grad = p.grad.float() if p.grad is not None else None, None
        torch.nn.utils.clip_grad_norm_(main, 1.0)
        opt.step()
        if bf16:
            with torch.no_grad():
                torch._foreach_copy_(params, main)
        now = clock()
        times.append(now - last)
        last = now
    return times


# ------------------------------------------------------------------------------------------------
# rlcore


class _StepClock:
    """A metrics sink that timestamps the end of every rollout and keeps the perf split."""

    def __init__(self, clock: Clock = wall_clock) -> None:
        self.clock = clock
        self.ends: list[float] = [clock()]
        self.perf: list[dict[str, float]] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if "rollout/weight_version" in metrics:
            self.ends.append(self.clock())
            self.perf.append({k: v for k, v in metrics.items() if k.startswith("perf/")})

    def close(self) -> None:
        pass


def rlcore_steps(
    model_dir: Path,
    prompts: Path,
    steps: int,
    offset: int,
    out: Path,
    bf16: bool = False,
    train_backend: str = "megatron",
    clock: Clock = wall_clock,
) -> tuple[list[float], list[dict[str, float]]]:
    from benchmarks.bench_tiny import prefix_partial
    from rlcore.backends import load_backend_kind
    from rlcore.config.flags import load_config
    from rlcore.launch.pieces import make_engine
    from rlcore.launch.prepare import load_run_data, load_tokenizer
    from rlcore.launch.ray.stacks import RayBackend
    from rlcore.loop import run
    from rlcore.loop.plan import plan

    config = load_config(
        [
            "--train-backend",
            train_backend,
            "--hf-checkpoint",
            str(model_dir),
            "--prompt-data",
            str(prompts),
            "--input-key",
            "prompt",
            "--label-key",
            "answer",
            "--num-rollout",
            str(steps),
            "--rollout-batch-size",
            str(PROMPTS),
            "--n-samples-per-prompt",
            str(SAMPLES),
            "--global-batch-size",
            str(PROMPTS * SAMPLES),
            "--micro-batch-size",
            str(PROMPTS * SAMPLES),
            "--rollout-max-response-len",
            str(NEW_TOKENS),
            "--rollout-temperature",
            "1.0",
            "--lr",
            "1e-4",
            "--clip-grad",
            "1.0",
            "--seed",
            str(offset),
            "--output-dir",
            str(out),
            *(["--bf16"] if bf16 else []),
        ]
    )
    tokenizer = load_tokenizer(config)
    data = load_run_data(config, tokenizer)
    steps_clock = _StepClock(clock)
    # The rank reserves one slot of the node, so it runs with all THREADS of the node's CPUs.
    runtime = load_backend_kind(train_backend).rank_runtime(config.model.backend_options)
    with RayBackend(runtime) as backend:
        engine = make_engine(config, tokenizer)
        try:
            steps_clock.ends = [clock()]
            run(plan(config), backend, engine, prefix_partial, data, steps_clock)
        finally:
            engine.close()
    ends = steps_clock.ends
    return [b - a for a, b in zip(ends, ends[1:], strict=False)], steps_clock.perf


def _summary(name: str, per_round: list[list[float]], unit: str = "s") -> float:
    medians = [statistics.median(r) for r in per_round]
    flat = [t for r in per_round for t in r]
    med = statistics.median(medians)
    print(
        f"{name:>20}: median {med:.3f} {unit}/step "
        f"(per-round medians {', '.join(f'{m:.3f}' for m in medians)}; "
        f"min {min(flat):.3f}, max {max(flat):.3f}, {len(flat)} steps)"
    )
    return med


def _split(name: str, perf: list[dict[str, float]]) -> None:
    keys = sorted({k for p in perf for k in p})
    print(
        f"  {name} split (median s): "
        + ", ".join(
            f"{k.removeprefix('perf/').removesuffix('_s')} "
            f"{statistics.median(p[k] for p in perf):.3f}"
            for k in keys
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--assets", type=Path, default=None, help="a bench-tiny build (default: build one)"
    )
    parser.add_argument(
        "--steps", type=int, default=20, help="measured steps per round (after 2 warm-up steps)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--bf16", action="store_true", help="also measure both in bf16 mixed precision"
    )
    parser.add_argument(
        "--train-backend",
        nargs="+",
        choices=["megatron", "fsdp"],
        default=["megatron"],
        help="rlcore's train backends, each timed in every round",
    )
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the CPU seconds of this process and all it started (Ray's ranks "
        "included) instead of wall time: for a loaded machine",
    )
    parser.add_argument(
        "--trl", action="store_true", help="also time TRL's GRPOTrainer (fp32; needs trl)"
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="write the ratio here (nox -s bench)"
    )
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    clock: Clock = TreeCPUClock() if args.cpu_time else wall_clock
    unit = "CPU s" if args.cpu_time else "s"
    if args.trl:
        from benchmarks.trl_grpo import trl_available, trl_steps

        if not trl_available():
            sys.exit("--trl: TRL is not installed (nox -s bench installs it: the bench group)")

    import ray

    tmp = Path(tempfile.mkdtemp(prefix="rl_step_"))
    warm = 2
    precisions = (True, False) if args.bf16 else (False,)
    backends: list[str] = list(dict.fromkeys(args.train_backend))
    names = ["floor", *backends, *(["trl"] if args.trl else [])]
    rounds: dict[tuple[str, bool], list[list[float]]] = {
        (n, bf16): [] for n in names for bf16 in precisions
    }
    perf: dict[tuple[str, bool], list[dict[str, float]]] = {
        (b, bf16): [] for b in backends for bf16 in precisions
    }
    try:
        if args.assets is None:
            from benchmarks.bench_tiny import build_assets

            args.assets = build_assets(tmp / "assets")
        # A new local instance even when another Ray cluster runs on this machine.
        ray.init(address="local", num_cpus=THREADS, include_dashboard=False, log_to_driver=False)
        model_dir = tmp / "model"  # the HF folder our CLI expects: weights and tokenizer together
        shutil.copytree(args.assets / "model", model_dir)
        for f in (args.assets / "tokenizer").iterdir():
            shutil.copy(f, model_dir / f.name)
        for r in range(args.rounds):
            for bf16 in precisions:
                dtype = "bf16" if bf16 else "fp32"
                for backend in backends:
                    ours, split = rlcore_steps(
                        model_dir,
                        args.assets / "prompts.jsonl",
                        warm + args.steps,
                        r,
                        tmp / f"run{r}-{bf16}-{backend}",
                        bf16,
                        backend,
                        clock,
                    )
                    rounds[backend, bf16].append(ours[warm:])
                    perf[backend, bf16] += split[warm:]
                floor = floor_steps(args.assets, warm + args.steps, r, bf16, clock)
                rounds["floor", bf16].append(floor[warm:])
                if args.trl and not bf16:
                    theirs = trl_steps(args.assets, warm + args.steps, r, tmp / f"trl{r}", clock)
                    rounds["trl", bf16].append(theirs[warm:])
                print(
                    f"round {r} {dtype}: "
                    + ", ".join(
                        f"{n} {statistics.median(rounds[n, bf16][-1]):.3f}"
                        for n in names
                        if rounds[n, bf16]
                    )
                    + f" {unit}/step",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"bench-tiny: {PROMPTS} prompts x {SAMPLES} samples, {NEW_TOKENS} new tokens, "
        f"{THREADS} threads, {args.rounds} alternating rounds of {args.steps} steps, "
        + ("CPU time of the process tree" if args.cpu_time else "wall time")
    )
    medians: dict[tuple[str, bool], float] = {}
    ratios: list[Ratio] = []
    for bf16 in sorted(precisions):
        dtype = "bf16" if bf16 else "fp32"
        for n in names:
            if rounds[n, bf16]:
                label = n if n in ("floor", "trl") else f"rlcore {n}"
                medians[n, bf16] = _summary(f"{label} {dtype}", rounds[n, bf16], unit)
        target = TARGETS[bf16]
        for backend in backends:
            ratio = medians[backend, bf16] / medians["floor", bf16]
            print(f"  {backend} {dtype} ratio: {ratio:.2f}x the floor (target <= {target:.2f}x)")
            _split(f"rlcore {backend} {dtype}", perf[backend, bf16])
        if "megatron" in backends:
            ratio = medians["megatron", bf16] / medians["floor", bf16]
            ratios.append(Ratio("rl_step", f"s/step vs plain PyTorch, {dtype}", ratio, target))
        if "fsdp" in backends and "megatron" in backends:
            ratio = medians["fsdp", bf16] / medians["megatron", bf16]
            verdict = "meets" if ratio <= FSDP_VS_MEGATRON else "MISSES"
            print(
                f"  fsdp/megatron {dtype}: {ratio:.2f}x; target fsdp <= {FSDP_VS_MEGATRON:.1f}x "
                f"megatron: {verdict}"
            )
            ratios.append(
                Ratio("rl_step", f"fsdp s/step vs megatron, {dtype}", ratio, FSDP_VS_MEGATRON)
            )
        if "fsdp" in backends and ("trl", bf16) in medians:
            ratio = medians["fsdp", bf16] / medians["trl", bf16]
            print(f"  fsdp/trl {dtype}: {ratio:.2f}x (no target)")
            ratios.append(Ratio("rl_step", f"fsdp s/step vs TRL, {dtype}", ratio, float("inf")))
    if args.bf16:
        print(
            "  bf16/fp32 seconds per step: "
            + ", ".join(
                f"{n} {medians[n, True] / medians[n, False]:.2f}"
                for n in names
                if (n, True) in medians
            )
        )
    write_ratios(args.json, ratios)


if __name__ == "__main__":
    main()
