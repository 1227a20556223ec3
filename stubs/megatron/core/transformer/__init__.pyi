from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

@dataclass
class ModuleSpec:
    module: tuple[str, ...] | type
    params: dict[str, Any] = ...
    # A dataclass of the module's own submodule specs (TransformerLayerSubmodules, ...).
    submodules: Any = None
    metainfo: dict[str, Any] = ...

class TransformerConfig:
    init_method_std: float
    bf16: bool
    params_dtype: torch.dtype
    sequence_parallel: bool
    num_moe_experts: int | None
    recompute_granularity: Literal["full", "selective"] | None
    def __init__(
        self,
        *,
        num_layers: int,
        hidden_size: int,
        num_attention_heads: int,
        ffn_hidden_size: int | None = None,
        num_query_groups: int | None = None,
        kv_channels: int | None = None,
        normalization: str = "LayerNorm",
        layernorm_epsilon: float = 1e-5,
        gated_linear_unit: bool = False,
        activation_func: Callable[[torch.Tensor], torch.Tensor] = ...,
        add_bias_linear: bool = True,
        add_qkv_bias: bool = False,
        qk_layernorm: bool = False,
        hidden_dropout: float = 0.1,
        attention_dropout: float = 0.1,
        bias_activation_fusion: bool = False,
        bias_dropout_fusion: bool = False,
        masked_softmax_fusion: bool = False,
        persist_layer_norm: bool = False,
        apply_rope_fusion: bool = False,
        gradient_accumulation_fusion: bool = False,
        tensor_model_parallel_size: int = 1,
        bf16: bool = False,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype = torch.float32,
        use_cpu_initialization: bool = False,
        calculate_per_token_loss: bool = False,
        init_method_std: float = 0.02,
        num_moe_experts: int | None = None,
        moe_ffn_hidden_size: int | None = None,
        moe_router_topk: int = 2,
        moe_router_pre_softmax: bool = False,
        moe_layer_freq: int | list[int] = 1,
        moe_grouped_gemm: bool = False,
        moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather",
        moe_router_load_balancing_type: str = "aux_loss",
        moe_aux_loss_coeff: float = 0.0,
        moe_permute_fusion: bool = False,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        recompute_granularity: Literal["full", "selective"] | None = None,
        recompute_method: Literal["uniform", "block"] | None = None,
        recompute_num_layers: int | None = None,
    ) -> None: ...
