"""A Llama-family Megatron ``GPTModel`` built from a Hugging Face ``config.json``.

Supported: RMSNorm, SwiGLU, RoPE (default, non-interleaved), grouped-query attention, tied or
untied embeddings, no biases (``LlamaForCausalLM`` and its look-alikes). Anything else fails in
:func:`read_hf_config` with a :class:`~rlcore.errors.ConfigError` naming the config field.

A critic is the same model with :class:`ValueHead` (hidden -> 1) in place of the output layer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, final

import attrs
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from rlcore.errors import ConfigError, ConfigProblem
from rlcore.specs import Precision, Role

__all__ = ["LlamaArch", "ValueHead", "build_gpt", "read_hf_config", "transformer_config"]

SUPPORTED_MODEL_TYPES: Final = ("llama",)


@final
@attrs.frozen
class LlamaArch:
    """The architecture numbers of a Llama-family model, read from its HF ``config.json``.

    ``hf_config`` keeps the whole original mapping so an exported checkpoint carries it unchanged.
    """

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    pad_token_id: int
    hf_config: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)

    def padded_vocab_size(self, tp_size: int) -> int:
        """The vocabulary rounded up to a multiple of ``tp_size`` (Megatron splits it evenly)."""
        return math.ceil(self.vocab_size / tp_size) * tp_size


def _rope_theta(cfg: Mapping[str, Any], problems: list[ConfigProblem]) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(params, Mapping):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            field = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
            problems.append(
                ConfigProblem(
                    f"{field}.rope_type",
                    f"RoPE scaling {rope_type!r} is not supported",
                    "use default RoPE",
                )
            )
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(cfg.get("rope_theta", 10000.0))


def arch_from_hf_config(cfg: Mapping[str, Any], source: str = "config.json") -> LlamaArch:
    """Validate an HF config mapping; every unsupported field is listed in one ``ConfigError``."""
    problems: list[ConfigProblem] = []

    def need(field: str, expected: object, hint: str) -> None:
        value = cfg.get(field, expected)
        if value != expected:
            message = f"{value!r} is not supported (expected {expected!r})"
            problems.append(ConfigProblem(field, message, hint))

    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(
            ConfigProblem(
                "model_type",
                f"{model_type!r} is not supported",
                f"the Megatron backend builds {', '.join(SUPPORTED_MODEL_TYPES)} models",
            )
        )
    need("hidden_act", "silu", "Llama models use SwiGLU (silu)")
    need("attention_bias", False, "biases in attention are not supported")
    need("mlp_bias", False, "biases in the MLP are not supported")
    sizes = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )
    for field in sizes:
        if not isinstance(cfg.get(field), int) or cfg[field] < 1:
            problems.append(
                ConfigProblem(field, f"must be a positive integer, got {cfg.get(field)!r}")
            )
    rope_theta = _rope_theta(cfg, problems)
    if problems:
        raise ConfigError(problems, source)
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    if heads % kv_heads:
        problems.append(
            ConfigProblem(
                "num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}"
            )
        )
    if problems:
        raise ConfigError(problems, source)
    pad = cfg.get("pad_token_id")
    return LlamaArch(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        pad_token_id=int(pad) if isinstance(pad, int) else 0,
        hf_config=dict(cfg),
    )


def read_hf_config(folder: Path) -> LlamaArch:
    """Read ``folder/config.json``; raises ``ConfigError`` naming each unsupported field."""
    path = Path(folder) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "config.json",
                    f"cannot read {path}: {exc}",
                    "point ModelSpec.hf_checkpoint at an HF model folder",
                )
            ],
            str(path),
        ) from exc
    return arch_from_hf_config(cfg, str(path))


def check_parallel(arch: LlamaArch, tp_size: int) -> None:
    """Tensor parallelism splits heads and query groups; refuse sizes that do not divide them."""
    problems = []
    if arch.num_kv_heads % tp_size:
        problems.append(
            ConfigProblem(
                "num_key_value_heads",
                f"{arch.num_kv_heads} is not divisible by tensor_model_parallel_size {tp_size}",
                "choose a tensor parallel size that divides the number of key/value heads",
            )
        )
    if arch.ffn_hidden_size % tp_size:
        problems.append(
            ConfigProblem(
                "intermediate_size",
                f"{arch.ffn_hidden_size} is not divisible by tensor_model_parallel_size {tp_size}",
            )
        )
    if problems:
        raise ConfigError(problems, "ParallelSpec")


def transformer_config(
    arch: LlamaArch, tp_size: int, precision: Precision = "float32"
) -> TransformerConfig:
    """No fusions, no dropout, CPU initialisation (deterministic across TP ranks); parameters in
    ``precision`` (``bf16`` also makes Megatron keep the attention softmax in fp32)."""
    bf16 = precision == "bfloat16"
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp_size,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=True,
        # DDP sums gradients: the loss is already divided by the global batch size.
        calculate_per_token_loss=True,
        init_method_std=float(arch.hf_config.get("initializer_range", 0.02)),
    )


@final
class ValueHead(torch.nn.Module):
    """The critic's head: hidden -> 1, replicated on every TP rank (no bias, like HF's ``score``).

    Called by ``GPTModel`` exactly where it calls its output layer, with the same signature.
    """

    def __init__(self, hidden_size: int, std: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size))
        torch.nn.init.normal_(self.weight, mean=0.0, std=std)

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        return F.linear(hidden_states, self.weight), None


def build_gpt(
    arch: LlamaArch, role: Role, device: torch.device, precision: Precision = "float32"
) -> GPTModel:
    """The Megatron model for ``role`` on this rank (initialised from the CPU generator), every
    parameter in ``precision``."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    check_parallel(arch, tp_size)
    config = transformer_config(arch, tp_size, precision)
    is_critic = role == "critic"
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=arch.padded_vocab_size(tp_size),
        max_sequence_length=arch.max_position_embeddings,
        parallel_output=False,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not is_critic,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
    if is_critic:
        model.output_layer = ValueHead(arch.hidden_size, config.init_method_std)
    # The value head is made in fp32; Megatron's layers already are in params_dtype.
    return model.to(device=device, dtype=config.params_dtype)
