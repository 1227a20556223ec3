"""Run every benchmark, each in its own process, and print one table of their ratios.

``nox -s bench`` runs this (not part of CI: the numbers mean something only on an otherwise idle
machine). ``--quick`` runs each with small settings: a smoke test of the scripts, not a
measurement. A benchmark that needs SGLang is skipped, with a line saying so, where SGLang is not
installed (run it in the ``nox -s sglang`` virtualenv: ``.nox/sglang/bin/python -m
benchmarks.weight_sync``).

    python -m benchmarks.run_all [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.results import Ratio, read_ratios

_SMALL_BRINGUP = [
    "--vocab",
    "1024",
    "--hidden",
    "128",
    "--ffn",
    "256",
    "--layers",
    "2",
    "--heads",
    "4",
]
_RL_STEP_SYSTEMS = ["--train-backend", "megatron", "fsdp", "--trl"]
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    # name (the module, or module:variant): (full arguments, --quick arguments)
    # rl_step --bf16 measures both precisions, alternating; each round times rlcore with both
    # backends, the plain-PyTorch floor and TRL's GRPOTrainer (issue #36).
    "rl_step": (
        ["--bf16", *_RL_STEP_SYSTEMS],
        ["--steps", "3", "--rounds", "1", "--bf16", *_RL_STEP_SYSTEMS],
    ),
    "async_step": ([], ["--steps", "3", "--rounds", "1", "--heavy-tokens", "16"]),
    "bringup": ([], _SMALL_BRINGUP),
    "bringup:bf16": (["--bf16"], [*_SMALL_BRINGUP, "--bf16"]),
    # The FSDP backend (issue #36): eval-only vs training bring-up, and LoRA vs full fine-tuning.
    "bringup:fsdp": (["--train-backend", "fsdp"], [*_SMALL_BRINGUP, "--train-backend", "fsdp"]),
    "bringup:fsdp-lora": (
        ["--train-backend", "fsdp", "--lora-rank", "16"],
        [*_SMALL_BRINGUP, "--train-backend", "fsdp", "--lora-rank", "8"],
    ),
    "weight_sync": (
        [],
        ["--repeats", "1", "--vocab-size", "256", "--hidden-size", "128", "--layers", "2"],
    ),
    # The embedded engine's row needs no SGLang: a ~100M-parameter model (issue #38).
    "weight_sync:embedded": (
        ["--modes", "embedded", "--hidden-size", "768", "--layers", "10"],
        ["--modes", "embedded", "--repeats", "1", "--vocab-size", "256", "--hidden-size", "128"],
    ),
    "rollout_scaling": (
        [],
        ["--lengths", "8", "16", "--rounds", "1", "--variable-max-tokens", "16", "--prompts", "2"],
    ),
    "packing": (
        [],
        ["--rounds", "1", "--repeats", "1", "--hidden", "64", "--layers", "1", "--long", "128"],
    ),
}
NEEDS_SGLANG = {"weight_sync"}
OPTIONAL_PACKAGES = {"--trl": "trl"}
"""An argument that needs a package outside rlcore's extras (``nox -s bench`` installs them: the
``bench`` dependency group): dropped, with a line saying so, where the package is missing."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small settings: a smoke run")
    args = parser.parse_args()
    has_sglang = importlib.util.find_spec("sglang") is not None
    ratios: list[Ratio] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rlcore-bench-") as tmp:
        for name, (full, quick) in BENCHMARKS.items():
            if name in NEEDS_SGLANG and not has_sglang:
                notes.append(
                    f"{name}: skipped, SGLang is not installed here; run it in the nox -s sglang "
                    f"virtualenv: .nox/sglang/bin/python -m benchmarks.{name.partition(':')[0]}"
                )
                print(notes[-1], flush=True)
                continue
            module = name.partition(":")[0]
            out = Path(tmp) / f"{name.replace(':', '-')}.json"
            chosen = quick if args.quick else full
            for flag, package in OPTIONAL_PACKAGES.items():
                if flag in chosen and importlib.util.find_spec(package) is None:
                    chosen = [a for a in chosen if a != flag]
                    notes.append(f"{name}: run without {flag}, {package} is not installed here")
                    print(notes[-1], flush=True)
            cmd = [sys.executable, "-m", f"benchmarks.{module}", *chosen]
            print(f"== {' '.join(cmd[1:])}", flush=True)
            done = subprocess.run([*cmd, "--json", str(out)])
            if done.returncode or not out.exists():
                notes.append(f"{name}: FAILED (exit code {done.returncode}), see its output above")
                print(notes[-1], flush=True)
                continue
            ratios += read_ratios(out)
    print()
    print(f"{'benchmark':12} {'measure':44} {'ratio':>7} {'target':>8}  verdict")
    for r in ratios:
        target = f"<= {r.target:g}" if r.target != float("inf") else "-"
        verdict = "meets" if r.meets else "MISSES"
        print(f"{r.benchmark:12} {r.measure:44} {r.value:6.2f}x {target:>8}  {verdict}")
    for note in notes:
        print(note)
    if args.quick:
        print("(--quick: small settings, not a measurement)")
    if any("FAILED" in note for note in notes):
        sys.exit(1)


if __name__ == "__main__":
    main()
