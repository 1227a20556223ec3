from collections.abc import Callable

import torch

class ModuleSpec: ...

class TransformerConfig:
    init_method_std: float
    bf16: bool
    params_dtype: torch.dtype
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
        params_dtype: torch.dtype = torch.float32,
        use_cpu_initialization: bool = False,
        calculate_per_token_loss: bool = False,
        init_method_std: float = 0.02,
    ) -> None: ...
