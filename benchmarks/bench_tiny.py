"""The bench-tiny workload's fixtures: its assets, built here, and its partial-credit reward.

bench-tiny (v1) is one GRPO step on a tiny random Llama on the CPU in fp32 (see
:mod:`benchmarks.rl_step`). Everything it needs is built from a fixed recipe, so anyone with a
clone reproduces the same bytes with the pinned versions (``constraints.txt``: torch 2.13.0,
transformers 5.24.0, tokenizers 0.23.3):

- ``tokenizer/``: a character tokenizer over ``"0123456789+= "`` (16 ids with ``<pad>``, ``<bos>``,
  ``<eos>`` = 0, 1, 2), left padding, ``<bos>`` prepended;
  :func:`rlcore.new_model.build_char_tokenizer`.
- ``model/``: ``LlamaForCausalLM`` (vocab 16, hidden 256, 4 layers, 4 heads, 2 KV heads, FFN 688,
  128 positions, untied), fp32, initialised after ``torch.manual_seed(0)``;
  :func:`rlcore.new_model.build_model`. 2,910,464 parameters.
- ``prompts.jsonl``: 1024 rows ``{"prompt": "a+b=", "answer": "a+b"}`` with ``a, b`` drawn by
  ``random.Random(1234).randint(10, 99)``, in that order.

:data:`REFERENCE_SHA256` records the hashes of the reference build (the workload's definition
lists the same); :func:`sha256_of` hashes a build to compare with them.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from rlcore.samples import Generation, Prompt

__all__ = [
    "ALPHABET",
    "NUM_PROMPTS",
    "REFERENCE_SHA256",
    "build_assets",
    "prefix_credit",
    "prefix_partial",
    "sha256_of",
]

ALPHABET: Final = "0123456789+= "
NUM_PROMPTS: Final = 1024
ASSET_FILES: Final = {
    "model.safetensors": "model/model.safetensors",
    "tokenizer.json": "tokenizer/tokenizer.json",
    "prompts.jsonl": "prompts.jsonl",
}
"""The hashed files: their names in the workload's hash list -> their paths in an asset folder."""
REFERENCE_SHA256: Final[Mapping[str, str]] = {
    "model.safetensors": "de9981645fbc6c3c399ba3e7b4c401262a1353ebf9f510036b2c8b3baad9b444",
    "prompts.jsonl": "cb0cc7d4869e42b37da97e5ae023f4aff9195f1b855e983bfdf5df3208af8b0f",
    "tokenizer.json": "6b80fed583ad62074c5edcf7814b33eef2526e153c87cf6fda1e39226be4aafa",
}
"""sha256 of the reference build (torch 2.13.0+cpu, transformers 5.24.0, tokenizers 0.23.3)."""


def prompt_rows() -> list[dict[str, str]]:
    """The workload's 1024 addition prompts, in order (first: ``66+24=`` -> ``90``)."""
    rng = random.Random(1234)
    rows = []
    for _ in range(NUM_PROMPTS):
        a = rng.randint(10, 99)
        b = rng.randint(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def build_assets(folder: Path) -> Path:
    """Write ``tokenizer/``, ``model/`` and ``prompts.jsonl`` into ``folder``; returns it.

    Deterministic: two builds with the same versions are byte-identical. The global torch RNG is
    left as it was.
    """
    from rlcore.new_model import Sizes, build_char_tokenizer, build_model

    folder.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer(folder / "tokenizer", ALPHABET, model_max_length=128)
    build_model(
        folder / "model",
        vocab_size=3 + len(ALPHABET),
        sizes=Sizes(
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=688,
            max_position_embeddings=128,
        ),
        tie_word_embeddings=False,
        seed=0,
    )
    lines = [json.dumps(row) for row in prompt_rows()]
    (folder / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def sha256_of(folder: Path) -> dict[str, str]:
    """The sha256 of each hashed asset file of a build, keyed as :data:`REFERENCE_SHA256`."""
    return {
        name: hashlib.sha256((folder / rel).read_bytes()).hexdigest()
        for name, rel in ASSET_FILES.items()
    }


def prefix_credit(text: str, answer: str) -> float:
    """1.0 when ``text`` starts with ``answer``, else the fraction of ``answer``'s leading
    characters that ``text`` matches (the workload's reward, on text)."""
    if text.startswith(answer):
        return 1.0
    agree = 0
    for got, want in zip(text, answer, strict=False):
        if got != want:
            break
        agree += 1
    return agree / len(answer)


def prefix_partial(prompt: Prompt, generation: Generation) -> float:
    """bench-tiny's partial-credit reward as an :class:`rlcore.RewardFn`.

    ``generation.text`` is already the decoded response up to and including the first stop token,
    without special tokens, which is the text the workload scores.
    """
    return prefix_credit(generation.text, prompt.label)
