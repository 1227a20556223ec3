"""Seconds per weight sync to a real SGLang server, per mode, vs copying the same bytes in memory.

Builds a ~100M-parameter Llama locally (random weights, fp32; no download), launches one SGLang
server on it (CPU unless ``--device cuda``), then for each weight-sync mode (``tensor``,
``distributed``, ``disk``) times ``SGLangEngine.update_weights`` of the full state dict. The
floor is the time to copy the same tensors into preallocated memory in this process
(``dst.copy_(src)`` per tensor), measured in the same run. It prints the median seconds of each
and the ratio to the floor; the target for the ``tensor`` mode on the CPU is <= 3x.

Every sync is checked: after it, the server generates with the version just pushed.

Usage (in an environment with SGLang, e.g. the ``nox -s sglang`` virtualenv)::

    python benchmarks/weight_sync.py [--repeats 5] [--modes tensor distributed disk]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rlcore.engines.sglang import (
    WEIGHT_SYNC_MODES,
    EngineOptions,
    LaunchSettings,
    SGLangEngine,
)
from rlcore.samples import Prompt, SamplingParams
from rlcore.tiny import build_char_tokenizer, build_tiny_llama

ALPHABET = "0123456789+= abcdefghijklmnopqrstuvwxyz"


def build_model(folder: Path, vocab_size: int) -> dict[str, torch.Tensor]:
    """About 100M parameters: hidden 768, 12 layers, MLP 2048, vocabulary 8192, untied head."""
    build_char_tokenizer(folder, ALPHABET)
    build_tiny_llama(
        folder,
        vocab_size=vocab_size,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        num_kv_heads=12,
        intermediate_size=2048,
        max_position_embeddings=256,
    )
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def median_seconds(run: Callable[[int], None], repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--modes", nargs="+", choices=WEIGHT_SYNC_MODES, default=list(WEIGHT_SYNC_MODES)
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="rlcore-bench-weight-sync-"))
    weights = build_model(work / "model", args.vocab_size)
    params = sum(t.numel() for t in weights.values())
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"model: {params / 1e6:.1f}M parameters, {nbytes / 2**20:.0f} MiB in {len(weights)} tensors")

    # A second set of weights to push: the server must end up with exactly these.
    pushed = {name: t * 1.01 for name, t in weights.items()}

    destination = {name: torch.empty_like(t) for name, t in pushed.items()}

    def copy_floor(_: int) -> None:
        for name, tensor in pushed.items():
            destination[name].copy_(tensor)

    copy_floor(0)  # fault the destination pages in once, as a warm buffer would be
    floor = median_seconds(copy_floor, max(args.repeats, 5))
    floor_s = statistics.median(floor)
    print(f"in-memory copy: {floor_s:.3f} s ({nbytes / floor_s / 2**30:.2f} GiB/s)")

    settings = LaunchSettings(
        model_path=work / "model",
        device=args.device,
        dtype="float32",
        max_total_tokens=2048,
        log_dir=work / "logs",
    )
    start = time.perf_counter()
    launcher = SGLangEngine.launch(settings, num_servers=1)
    print(f"server up in {time.perf_counter() - start:.0f} s: {launcher.servers[0].url}")
    prompt = [Prompt(0, "", (1, 5, 6, 7))]
    rows: list[tuple[str, float]] = []
    try:
        urls = [server.url for server in launcher.servers]
        for mode in WEIGHT_SYNC_MODES:
            if mode not in args.modes:
                continue
            options = EngineOptions(weight_sync=mode, sync_dir=work / "sync")
            with SGLangEngine.connect(urls, options) as engine:
                version = 100 * (1 + WEIGHT_SYNC_MODES.index(mode))

                def sync(i: int, engine: SGLangEngine = engine, base: int = version) -> None:
                    engine.update_weights(pushed.items(), base + i)

                sync(-1)  # warm-up: group join, buffer allocation, first file
                times = median_seconds(sync, args.repeats)
                generation = engine.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0))
                assert generation[0].weight_version == version + args.repeats - 1, generation
            seconds = statistics.median(times)
            rows.append((mode, seconds))
            print(
                f"{mode:12s} {seconds:7.3f} s/sync (min {min(times):.3f}, max {max(times):.3f})"
                f"  = {seconds / floor_s:5.2f}x the copy"
            )
    finally:
        launcher.close()

    print()
    print(f"{'mode':12s} {'s/sync':>8s} {'x copy':>8s}")
    print(f"{'copy':12s} {floor_s:8.3f} {1.0:8.2f}")
    for name, seconds in rows:
        print(f"{name:12s} {seconds:8.3f} {seconds / floor_s:8.2f}")
    tensor = dict(rows).get("tensor")
    if tensor is not None:
        verdict = "meets" if tensor <= 3 * floor_s else "misses"
        print(f"tensor mode {verdict} the <= 3x target ({tensor / floor_s:.2f}x)")


if __name__ == "__main__":
    main()
