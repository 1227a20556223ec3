"""Rollout throughput as answers grow: the embedded engine beside ``model.generate`` (and SGLang).

The workload (issue #13): a 17M-parameter Llama built with
:func:`rlcore.new_model.build_model`
(hidden 512, 6 layers, 8 heads, 4 KV heads, FFN 1376, the 16-token bench-tiny vocabulary, random
fp32 weights, positions enough for the longest answer), 32 distinct 17-token prompts x 4 samples,
sampling at temperature 1, 2 threads. Per answer length (default 32, 128, 512 and 2048 new tokens)
every response is exactly that long (``SamplingParams.ignore_eos``: no stop token), and each of
these is timed in the same process, alternating order round by round:

- **embedded**: :class:`rlcore.engines.embedded.EmbeddedEngine` (tokens and their log-probs),
  decoding with rlcore's CPU attention kernel (:mod:`rlcore.engines.decode_attention`).
- **sdpa**: the same engine with ``decode_kernel=False``: torch's SDPA reads the cache, as it
  does wherever the kernel does not apply (GPU, bf16). The two columns side by side are what the
  kernel is worth.
- **generate**: Hugging Face ``model.generate`` sampling the same batch with ``output_logits``,
  plus the log-softmax/gather that turns those logits into the sampled tokens' log-probs.
- **sglang** (only where SGLang is importable, e.g. the ``nox -s sglang`` virtualenv): a CPU SGLang
  server on the same model folder with as many threads, ``ignore_eos`` fixed lengths, through
  :class:`rlcore_sglang.SGLangEngine`.

Then a variable-length case: the same batch with a stop token the random model samples about
once in 16 tokens, so most answers end within a few dozen tokens and a few run long
(``--variable-max-tokens`` caps them): what a batch whose rows mostly stop early costs.

It prints tokens per second (median over rounds), each engine's cost per token relative to its own
at the shortest length, and the ratios the issue's targets are about: the embedded engine's cost
per token at 512 vs at 32 new tokens (<= 1.5x) and its time vs ``model.generate``'s at 512 and
2048 new tokens (<= 0.67x, i.e. >= 1.5x the throughput). Load on the machine is printed before and
after (``os.getloadavg``): on a shared machine the numbers move with it.

Usage::

    python -m benchmarks.rollout_scaling [--lengths 32 128 512 2048] [--rounds 3]
        [--variable-max-tokens 512] [--prompts 32] [--no-sglang] [--json PATH]

At 2048 new tokens ``model.generate`` takes tens of minutes per round on 2 CPU threads; pass
``--lengths 32 128 512`` for a shorter run.

On a machine loaded beyond its cores, 2 threads make every operator wait for its second thread to
be scheduled: at load ~20 on 2 cores a 32-token batch took 342 s with 2 threads and 12 s with 1.
There, pass ``--threads 1`` (both engines get the same) and read the CPU-time table too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")  # --threads sets torch's count below

import torch

from benchmarks.results import Ratio, write_ratios
from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.protocols.engine import RolloutEngine
from rlcore.samples import Prompt, SamplingParams

THREADS = 2
PROMPTS, SAMPLES, PROMPT_TOKENS = 32, 4, 17
ALPHABET = "0123456789+= "
VOCAB = 3 + len(ALPHABET)
STOP_ID = 3 + ALPHABET.index("=")  # the variable-length case's stop token
GENERATE_TARGET = 0.667  # embedded time / generate time: >= 1.5x generate's throughput
GROWTH_TARGET = 1.5  # embedded cost per token at 512 new tokens / at 32

Runner = Callable[[int, bool], int]
"""``run(max_new_tokens, variable) -> tokens generated`` (``variable``: stop on ``STOP_ID``)."""


def build_assets(folder: Path, max_new_tokens: int) -> HFTokenizer:
    from rlcore.new_model import Sizes, build_char_tokenizer, build_model

    tokenizer = build_char_tokenizer(folder / "model", ALPHABET)  # SGLang reads it from there
    build_model(
        folder / "model",
        vocab_size=VOCAB,
        sizes=Sizes(
            hidden_size=512,
            num_layers=6,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=1376,
            # SGLang ends an answer a few positions short of the model's context length (with
            # room for exactly prompt + answer, 128-token answers came back shorter); RoPE keeps
            # no table, so the room costs nothing.
            max_position_embeddings=max(128, PROMPT_TOKENS + max_new_tokens + 64),
        ),
        seed=0,
    )
    return HFTokenizer(tokenizer)


def make_batch(tok: HFTokenizer, distinct: int = PROMPTS) -> list[Prompt]:
    """``distinct`` (issue: 32) different 17-token prompts (bos + 16 characters), each 4 times."""
    rng = random.Random(0)
    texts: list[str] = []
    while len(texts) < distinct:
        text = "".join(rng.choice(ALPHABET[:12]) for _ in range(PROMPT_TOKENS - 1))
        if text not in texts:
            texts.append(text)
    prompts = [Prompt(index=i, text=t, token_ids=tuple(tok.encode(t))) for i, t in enumerate(texts)]
    assert all(len(p.token_ids) == PROMPT_TOKENS for p in prompts)
    return [p for p in prompts for _ in range(SAMPLES)]


def params_for(max_new_tokens: int, variable: bool) -> SamplingParams:
    if variable:
        return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(STOP_ID,))
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)


def engine_runner(engine: RolloutEngine, batch: list[Prompt]) -> Runner:
    """``engine`` generating ``batch``; fixed-length answers are checked to be that long."""

    def run(max_new_tokens: int, variable: bool) -> int:
        gens = engine.generate(batch, params_for(max_new_tokens, variable))
        if not variable:
            assert all(len(g.token_ids) == max_new_tokens for g in gens)
        return sum(len(g.token_ids) for g in gens)

    return run


def embedded_runner(
    model_dir: Path, batch: list[Prompt], tok: HFTokenizer, *, decode_kernel: bool
) -> Runner:
    from rlcore.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine.from_pretrained(model_dir, tok, seed=0, decode_kernel=decode_kernel)

    return engine_runner(engine, batch)


def generate_runner(model_dir: Path, batch: list[Prompt]) -> Runner:
    """``model.generate`` on the whole batch (it has no prefix sharing), returning the logits, and
    the sampled tokens' log-probs computed from them, as a rollout needs."""
    from transformers import AutoModelForCausalLM, GenerationConfig, GenerationMixin

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert isinstance(model, GenerationMixin)
    # The saved generation config's eos (2) would end answers: each call says which stop it wants.
    model.generation_config.eos_token_id = None
    ids = torch.tensor([list(p.token_ids) for p in batch])
    mask = torch.ones_like(ids)
    seeds = iter(range(10**6))

    def run(max_new_tokens: int, variable: bool) -> int:
        # GenerationConfig's constructor takes untyped ``**kwargs``.
        config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            eos_token_id=STOP_ID if variable else None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        torch.manual_seed(next(seeds))
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
            tokens = out.sequences[:, ids.shape[1] :]
            logits = torch.stack(out.logits, dim=1).float()
            torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1))
        if not variable:
            assert tokens.shape[1] == max_new_tokens, tokens.shape
            return int(tokens.numel())
        # Each row up to and including its first stop token; after it, padding.
        before_stop = (tokens == STOP_ID).int().cumsum(dim=1) - (tokens == STOP_ID).int() == 0
        return int(before_stop.sum())

    return run


def sglang_runner(
    model_dir: Path,
    batch: list[Prompt],
    work: Path,
    longest: int,
    threads: int,
    stack: contextlib.ExitStack,
) -> Runner:
    """A CPU SGLang server on ``model_dir`` with ``threads`` threads (closed by ``stack``), through
    rlcore's client."""
    from rlcore_sglang import LaunchSettings, SGLangEngine

    settings = LaunchSettings(
        model_path=model_dir,
        device="cpu",
        dtype="float32",
        max_total_tokens=len(batch) * (PROMPT_TOKENS + longest) + 1024,
        log_dir=work / "sglang-logs",
        env={"OMP_NUM_THREADS": str(threads)},
    )
    start = time.perf_counter()
    engine = SGLangEngine.launch(settings, num_servers=1)
    stack.callback(engine.close)
    print(f"sglang server up in {time.perf_counter() - start:.0f} s", flush=True)

    return engine_runner(engine, batch)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} CPUs"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variable-max-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=THREADS, help="torch threads (issue: 2)")
    parser.add_argument(
        "--prompts",
        type=int,
        default=PROMPTS,
        help=f"distinct prompts, each sampled {SAMPLES} times (issue: {PROMPTS}); fewer for a "
        "shorter run on a busy machine",
    )
    parser.add_argument("--no-sglang", action="store_true", help="skip SGLang even if installed")
    parser.add_argument(
        "--json", type=Path, default=None, help="write the ratios here (nox -s bench)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = sorted(args.lengths)
    longest = max([*lengths, args.variable_max_tokens])
    print(f"before: {load()}", flush=True)
    print(
        f"{args.prompts} distinct prompts x {SAMPLES} samples, {args.threads} threads, "
        f"{args.rounds} rounds",
        flush=True,
    )

    seconds: dict[tuple[str, int, bool], list[float]] = {}
    cpu_seconds: dict[tuple[str, int, bool], list[float]] = {}  # this process's CPU time
    tokens: dict[tuple[str, int, bool], list[int]] = {}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlcore-rollout-")))
        tok = build_assets(work, longest)
        batch = make_batch(tok, args.prompts)
        runners: dict[str, Runner] = {
            "embedded": embedded_runner(work / "model", batch, tok, decode_kernel=True),
            "sdpa": embedded_runner(work / "model", batch, tok, decode_kernel=False),
            "generate": generate_runner(work / "model", batch),
        }
        if not args.no_sglang and importlib.util.find_spec("sglang") is not None:
            runners["sglang"] = sglang_runner(
                work / "model", batch, work, longest, args.threads, stack
            )
        cases = [(n, False) for n in lengths] + [(args.variable_max_tokens, True)]
        for run in runners.values():  # warm-up: first-call allocations, server caches
            run(8, False)
        for round_ in range(args.rounds):
            for n, variable in cases:
                # Alternate which engine goes first, so a load spike hurts neither alone.
                order = list(runners.items())
                if round_ % 2:
                    order.reverse()
                for name, run in order:
                    start, start_cpu = time.perf_counter(), time.process_time()
                    count = run(n, variable)
                    elapsed = time.perf_counter() - start
                    elapsed_cpu = time.process_time() - start_cpu
                    seconds.setdefault((name, n, variable), []).append(elapsed)
                    cpu_seconds.setdefault((name, n, variable), []).append(elapsed_cpu)
                    tokens.setdefault((name, n, variable), []).append(count)
                    kind = f"variable (max {n})" if variable else f"{n} new tokens"
                    print(
                        f"round {round_ + 1} {kind:20s} {name:9s} {elapsed:8.2f} s "
                        f"{count / elapsed:8.0f} tok/s {count / elapsed_cpu:8.0f} tok/CPU-s "
                        f"({load()})",
                        flush=True,
                    )
    print(f"after: {load()}")

    def tok_s(name: str, n: int, variable: bool, clock: str = "wall") -> float:
        key = (name, n, variable)
        spent = seconds[key] if clock == "wall" else cpu_seconds[key]
        return statistics.median(c / s for c, s in zip(tokens[key], spent, strict=True))

    variable_key = (args.variable_max_tokens, True)
    answer_tokens = statistics.median(tokens[("embedded", *variable_key)]) / len(batch)
    base = lengths[0]
    in_process = [name for name in runners if name != "sglang"]  # CPU time is this process's
    for clock, names in (("wall", list(runners)), ("cpu", in_process)):
        unit = "tokens per second" if clock == "wall" else "tokens per CPU-second of this process"
        print()
        print(f"medians of {args.rounds} alternating rounds, {args.threads} threads, {unit}:")
        print(
            f"{'new tokens':>12} "
            + " ".join(f"{name:>10}" for name in names)
            + " "
            + " ".join(f"{'cost/tok ' + name[:5]:>15}" for name in names)
        )
        for n in lengths:
            rates = [tok_s(name, n, False, clock) for name in names]
            growth = [
                tok_s(name, base, False, clock) / r for name, r in zip(names, rates, strict=True)
            ]
            print(
                f"{n:>12} "
                + " ".join(f"{r:>10,.0f}" for r in rates)
                + " "
                + " ".join(f"{g:>14.2f}x" for g in growth)
            )
        print(
            f"{'variable':>12} "
            + " ".join(f"{tok_s(name, *variable_key, clock):>10,.0f}" for name in names)
        )
    print(
        f"(cost/tok: cost per token relative to the same engine at {base} new tokens; variable: "
        f"stop token {STOP_ID}, at most {args.variable_max_tokens} new tokens, the embedded "
        f"engine's answers averaged {answer_tokens:.1f} tokens)"
    )

    def target_ratios(clock: str) -> list[Ratio]:
        suffix = "" if clock == "wall" else " (CPU time)"
        out = []
        if 32 in lengths and 512 in lengths:
            growth = tok_s("embedded", 32, False, clock) / tok_s("embedded", 512, False, clock)
            out.append(
                Ratio("rollout", f"embedded cost/token 512 vs 32{suffix}", growth, GROWTH_TARGET)
            )
        for n in (n for n in lengths if n >= 512):
            ratio = tok_s("generate", n, False, clock) / tok_s("embedded", n, False, clock)
            out.append(
                Ratio("rollout", f"embedded vs generate time, {n}{suffix}", ratio, GENERATE_TARGET)
            )
        ratio = tok_s("generate", *variable_key, clock) / tok_s("embedded", *variable_key, clock)
        out.append(Ratio("rollout", f"embedded vs generate, variable{suffix}", ratio, math.inf))
        return out

    ratios = target_ratios("wall")
    for n in lengths:
        ratio = tok_s("sdpa", n, False) / tok_s("embedded", n, False)
        ratios.append(Ratio("rollout", f"embedded vs its SDPA decode time, {n}", ratio, math.inf))
    if "sglang" in runners:
        for n in lengths:
            ratio = tok_s("sglang", n, False) / tok_s("embedded", n, False)
            ratios.append(Ratio("rollout", f"embedded vs sglang time, {n}", ratio, math.inf))
    print()
    for r in [*ratios, *target_ratios("cpu")]:
        target = f"<= {r.target:g}" if r.target != math.inf else "(no target)"
        verdict = "" if r.target == math.inf else ("meets" if r.meets else "MISSES")
        print(f"{r.measure:46s} {r.value:6.2f}x {target:>12} {verdict}")
    write_ratios(args.json, ratios)


if __name__ == "__main__":
    main()
