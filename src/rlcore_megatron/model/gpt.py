"""A Megatron ``GPTModel`` for a model family of :mod:`rlcore_megatron.model.arch`.

Llama, Qwen2, Qwen3 and Qwen3-MoE map onto Megatron's local (no Transformer Engine) layer specs:
RMSNorm, SwiGLU, RoPE (default, non-interleaved; Llama 3 scaling applied to the frequencies),
grouped-query attention, optional QKV biases and QK-norm, and for Qwen3-MoE top-k routed
experts (``SequentialMLP``, dropless) in the sparse layers and dense MLPs in the others.

A critic is the same model with :class:`ValueHead` (hidden -> 1) in place of the output layer.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, TypedDict, final

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    TransformerBlockSubmodules,
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer import ModuleSpec, TransformerConfig

from rlcore.errors import ConfigError, ConfigProblem
from rlcore.specs import Precision, Role
from rlcore_megatron.model import moe, rope
from rlcore_megatron.model.arch import ModelArch
from rlcore_megatron.options import MegatronOptions

__all__ = [
    "RMSNorm",
    "ValueHead",
    "build_gpt",
    "check_parallel",
    "decoder_spec",
    "transformer_config",
    "uses_sequence_parallel",
]


def check_parallel(arch: ModelArch, tp_size: int, ep_size: int = 1) -> None:
    """Tensor parallelism splits heads and MLP widths, expert parallelism the experts: refuse
    sizes that do not divide them."""
    problems = []
    if arch.num_kv_heads % tp_size:
        problems.append(
            ConfigProblem(
                "num_key_value_heads",
                f"{arch.num_kv_heads} is not divisible by tensor_model_parallel_size {tp_size}",
                "choose a tensor parallel size that divides the number of key/value heads",
            )
        )
    dense_layers = arch.moe is None or not all(arch.moe.moe_layers)
    if dense_layers and arch.ffn_hidden_size % tp_size:
        problems.append(
            ConfigProblem(
                "intermediate_size",
                f"{arch.ffn_hidden_size} is not divisible by tensor_model_parallel_size {tp_size}",
            )
        )
    if ep_size > 1 and arch.moe is None:
        problems.append(
            ConfigProblem(
                "expert_model_parallel_size",
                f"{ep_size}, but this {arch.family} model has no experts",
                "use expert parallelism only for mixture-of-experts models",
            )
        )
    elif arch.moe is not None and arch.moe.ffn_hidden_size % tp_size:
        problems.append(
            ConfigProblem(
                "moe_intermediate_size",
                f"{arch.moe.ffn_hidden_size} is not divisible by tensor_model_parallel_size "
                f"{tp_size} (experts are split over the tensor parallel ranks too)",
            )
        )
    if arch.moe is not None and arch.moe.num_experts % ep_size:
        problems.append(
            ConfigProblem(
                "num_experts",
                f"{arch.moe.num_experts} is not divisible by expert_model_parallel_size {ep_size}",
                "choose an expert parallel size that divides the number of experts",
            )
        )
    if problems:
        raise ConfigError(problems, "ParallelSpec")


class _MoEFields(TypedDict, total=False):
    """The ``TransformerConfig`` fields of a mixture-of-experts model."""

    num_moe_experts: int
    moe_ffn_hidden_size: int
    moe_router_topk: int
    moe_router_pre_softmax: bool
    moe_layer_freq: list[int]
    moe_grouped_gemm: bool
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"]
    moe_router_load_balancing_type: str
    moe_aux_loss_coeff: float
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int
    moe_permute_fusion: bool


def uses_sequence_parallel(arch: ModelArch, tp_size: int) -> bool:
    """Megatron trains MoE layers under tensor parallelism only with sequence parallelism (the
    sequence is split over the TP ranks between attention blocks); dense models do without."""
    return arch.moe is not None and tp_size > 1


def transformer_config(
    arch: ModelArch,
    tp_size: int,
    ep_size: int = 1,
    moe_aux_loss_coeff: float = 0.0,
    precision: Precision = "float32",
    options: MegatronOptions | None = None,
) -> TransformerConfig:
    """No fusions, no dropout, CPU initialisation (deterministic across TP ranks); parameters in
    ``precision`` (``bfloat16`` also makes Megatron keep the attention softmax in fp32).

    ``ep_size`` ranks share the experts out, and each expert is split over the tensor parallel
    ranks like a dense MLP (``expert_tensor_parallel_size = tp_size``, Megatron's default: with
    whole experts on TP ranks that each see their own sequence shard, megatron-core 0.16 reduces
    no expert gradient over the TP ranks when ``ep_size`` is 1).
    ``moe_aux_loss_coeff > 0`` adds Megatron's load-balancing loss (Switch Transformer, Fedus et
    al. 2021) to the training loss. ``options``' activation recompute goes to Megatron's own
    (``recompute_granularity``, ``recompute_method``, ``recompute_num_layers``; selective
    recomputes Megatron's default module, the core attention).
    """
    recompute = options if options is not None else MegatronOptions()
    bf16 = precision == "bfloat16"
    experts = arch.moe
    moe_fields: _MoEFields = {}
    if experts is not None:
        moe_fields = {
            "num_moe_experts": experts.num_experts,
            "moe_ffn_hidden_size": experts.ffn_hidden_size,
            "moe_router_topk": experts.top_k,
            # Softmax over the top-k logits is the top-k probabilities renormalised
            # (norm_topk_prob); pre-softmax keeps the probabilities over all experts.
            "moe_router_pre_softmax": not experts.norm_topk_prob,
            "moe_layer_freq": [int(sparse) for sparse in experts.moe_layers],
            "moe_grouped_gemm": False,
            "moe_token_dispatcher_type": "allgather",
            "moe_router_load_balancing_type": "aux_loss" if moe_aux_loss_coeff > 0 else "none",
            "moe_aux_loss_coeff": moe_aux_loss_coeff,
            "expert_model_parallel_size": ep_size,
            "expert_tensor_parallel_size": tp_size,
            "moe_permute_fusion": False,
        }
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
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=uses_sequence_parallel(arch, tp_size),
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=True,
        # DDP sums gradients: the loss is already divided by the global batch size.
        calculate_per_token_loss=True,
        init_method_std=float(arch.hf_config.get("initializer_range", 0.02)),
        recompute_granularity=recompute.recompute_granularity,
        recompute_method=recompute.recompute_method,
        recompute_num_layers=recompute.recompute_num_layers,
        **moe_fields,
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


def _set_rope_frequencies(model: GPTModel, arch: ModelArch) -> None:
    """RoPE's inverse frequencies ``[head_dim / 2]`` as transformers computes them: from the
    exact (float) ``rope_theta``, and with Llama 3's scaling at the config's own factors
    (Megatron's constructor takes an integer base, and only ``factor`` of the four)."""
    dim = arch.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim
    inv_freq = 1.0 / (arch.rope_theta**exponents)
    scaling = arch.rope_scaling
    if scaling is not None:
        inv_freq = model.rotary_pos_emb._apply_scaling(
            inv_freq,
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
        )
    model.rotary_pos_emb.inv_freq = inv_freq


class RMSNorm(torch.nn.RMSNorm):
    """RMSNorm (``torch.nn.RMSNorm``, what Megatron's local spec builds) that also serves under
    sequence parallelism: its weight is marked ``sequence_parallel``, so that
    ``finalize_model_grads`` sums its gradient over the TP ranks' sequence shards, as Transformer
    Engine's and Apex's norms mark theirs. Megatron's ``WrappedTorchNorm`` refuses sequence
    parallelism instead, and without TE or Apex (the CPU; GPUs without them) that refusal would
    rule out MoE under tensor parallelism, which Megatron trains only with sequence parallelism.
    """

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object
    ) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # read by finalize_model_grads


def _with_rms_norm(layer: ModuleSpec, qk_norm: bool) -> ModuleSpec:
    """``layer``'s spec with :class:`RMSNorm` for its norms (and its QK-norms, if it has them)."""
    parts = layer.submodules
    attention = parts.self_attention
    heads = attention.submodules
    if qk_norm:
        heads = dataclasses.replace(heads, q_layernorm=RMSNorm, k_layernorm=RMSNorm)
    parts = dataclasses.replace(
        parts,
        input_layernorm=RMSNorm,
        pre_mlp_layernorm=RMSNorm,
        self_attention=dataclasses.replace(attention, submodules=heads),
    )
    return dataclasses.replace(layer, submodules=parts)


def decoder_spec(arch: ModelArch, config: TransformerConfig) -> TransformerBlockSubmodules:
    """One local (no Transformer Engine) layer spec per layer, sparse or dense, with
    :class:`RMSNorm` as every norm."""
    if arch.moe is None:
        layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm)
        layers = [layer] * arch.num_layers
    else:
        moe.fix_router()
        block = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        )
        assert block.layer_specs is not None  # one spec per layer, built from the config
        layers = list(block.layer_specs)
    return TransformerBlockSubmodules(
        layer_specs=[_with_rms_norm(layer, arch.qk_norm) for layer in layers], layer_norm=RMSNorm
    )


def build_gpt(
    arch: ModelArch,
    role: Role,
    device: torch.device,
    moe_aux_loss_coeff: float = 0.0,
    precision: Precision = "float32",
    options: MegatronOptions | None = None,
) -> GPTModel:
    """The Megatron model for ``role`` on this rank (initialised from the CPU generator), every
    parameter in ``precision``; ``options``: activation recompute (:func:`transformer_config`)."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    check_parallel(arch, tp_size, ep_size)
    rope.install()  # the same RoPE bits without recomputing cos/sin per layer (issue #38)
    config = transformer_config(arch, tp_size, ep_size, moe_aux_loss_coeff, precision, options)
    is_critic = role == "critic"
    model = GPTModel(
        config=config,
        transformer_layer_spec=decoder_spec(arch, config),
        vocab_size=arch.padded_vocab_size(tp_size),
        max_sequence_length=arch.max_position_embeddings,
        parallel_output=False,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not is_critic,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
    _set_rope_frequencies(model, arch)
    if is_critic:
        model.output_layer = ValueHead(arch.hidden_size, config.init_method_std)
    # The value head is made in fp32; Megatron's layers already are in params_dtype.
    return model.to(device=device, dtype=config.params_dtype)
