"""The model families the Megatron backend supports, as tests build them: the *published*
``config.json`` of a small member of each family, cut down, and a builder that writes a randomly
initialised HF checkpoint of it (with transformers, nothing downloaded).

What is cut, and why (each test must run in seconds on a shared 2-core CPU):

- ``num_hidden_layers`` -> 2 (3 where a test needs a dense layer between sparse ones) and, for
  Qwen3-MoE, ``num_experts`` 128 -> 16 (``num_experts_per_tok`` stays 8).
- The widths: ``hidden_size``, ``intermediate_size``, ``moe_intermediate_size``, the number of
  heads and ``head_dim`` shrink by the same factor, keeping each family's structure: the
  grouped-query ratio (heads per KV head: Llama 4, Qwen2.5 7, Qwen3 2, Qwen3-MoE 8), whether
  ``head_dim`` is implicit (``hidden / heads``: Qwen2.5) or explicit and unequal to it (Qwen3:
  ``heads * head_dim = 2 * hidden``), and the MLP/hidden ratios. Real widths would make the
  embedding alone 262M parameters (Llama 3.2 1B), too much for a test.

Kept as published: the vocabulary (128,256 and 151,936: Qwen's needs padding for tensor parallel
2), tied or untied embeddings, QKV biases, QK-norm, RoPE theta and Llama 3 scaling, norm epsilon,
``max_position_embeddings``, ``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``, and
every other field.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import torch

from rlcore_megatron.model.arch import Family

__all__ = [
    "ALPHABET",
    "FAMILIES",
    "PUBLISHED",
    "Family",
    "FamilyModels",
    "build_family_model",
    "greedy_reference",
    "tiny_config",
]

ALPHABET: Final = "0123456789+= abcdefghijklmnopqrstuvwxyz"
"""The character tokenizer's alphabet for engine tests (ids 3 to 41 after the 3 specials)."""

FAMILIES: Final[tuple[Family, ...]] = ("llama", "qwen2", "qwen3", "qwen3_moe")

PUBLISHED: Final[Mapping[Family, Mapping[str, Any]]] = {
    # meta-llama/Llama-3.2-1B
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    # Qwen/Qwen2.5-0.5B
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Qwen/Qwen3-0.6B
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Qwen/Qwen3-30B-A3B
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 48,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}
"""Each family's published ``config.json``, verbatim."""

_CUT: Final[Mapping[Family, Mapping[str, Any]]] = {
    # 32 heads x 64 over 8 KV heads -> 8 x 8 over 2 (ratio 4); hidden = heads * head_dim.
    "llama": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 256,
    },
    # 14 heads over 2 (ratio 7) kept; head_dim implicit: 896 / 14 = 64 -> 112 / 14 = 8.
    "qwen2": {"num_hidden_layers": 2, "hidden_size": 112, "intermediate_size": 608},
    # 16 x 128 over 8 (ratio 2), q width 2 x hidden -> 8 x 16 over 4, 128 = 2 x 64.
    "qwen3": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
        "intermediate_size": 192,
    },
    # 32 x 128 over 4 (ratio 8), q width 2 x hidden -> 16 x 8 over 2, 128 = 2 x 64.
    "qwen3_moe": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 192,
        "moe_intermediate_size": 24,
        "num_experts": 16,
    },
}


def tiny_config(family: Family, **overrides: Any) -> dict[str, Any]:
    """The published config of ``family`` with the cuts above, stored as fp32, and
    ``overrides``."""
    cfg = copy.deepcopy(dict(PUBLISHED[family]))
    cfg.update(_CUT[family])
    cfg["torch_dtype"] = "float32"
    cfg.update(overrides)
    return cfg


def build_family_model(
    folder: Path,
    config: Mapping[str, Any],
    *,
    seed: int = 0,
    peaked: bool = False,
    alphabet: str | None = None,
) -> Path:
    """Write a randomly initialised fp32 HF checkpoint of ``config`` into ``folder`` (with a
    character tokenizer over ``alphabet`` when given: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2).

    Norm weights and biases start at 1 and 0 in transformers; both get noise here so that a
    mis-mapped norm or bias cannot hide. ``peaked`` scales the output layer by 40, so greedy
    decoding has clear winners (a random model's logits are nearly flat and their argmax would
    hinge on rounding). The global torch RNG state is left as it was.
    """
    from transformers import PreTrainedModel

    from rlcore.new_model import build_char_tokenizer, write_model

    def noisy(model: PreTrainedModel) -> None:
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
        if peaked:
            # transformers leaves get_output_embeddings unannotated.
            model.get_output_embeddings().weight.mul_(40.0)  # type: ignore[no-untyped-call]

    write_model(folder, config, seed=seed, adjust=noisy)
    if alphabet is not None:
        build_char_tokenizer(folder, alphabet)
    return folder


class FamilyModels:
    """Family checkpoints under ``root``, each built on first request and then reused."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def folder(
        self,
        family: Family,
        *,
        seed: int = 0,
        peaked: bool = False,
        alphabet: str | None = None,
        **overrides: Any,
    ) -> Path:
        """The checkpoint of ``tiny_config(family, **overrides)`` built with these options."""
        key = repr((family, seed, peaked, alphabet, sorted(overrides.items())))
        if key not in self._built:
            folder = self.root / f"{family}-{len(self._built)}"
            build_family_model(
                folder,
                tiny_config(family, **overrides),
                seed=seed,
                peaked=peaked,
                alphabet=alphabet,
            )
            self._built[key] = folder
        return self._built[key]


@torch.no_grad()
def greedy_reference(
    model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from a transformers model (fp32), one full forward per
    step: no cache, nothing shared with the engines under test."""
    ids = list(prompt)
    tokens: list[int] = []
    log_probs: list[float] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(lp))
        tokens.append(token)
        log_probs.append(float(lp[token]))
        ids.append(token)
    return tokens, log_probs
