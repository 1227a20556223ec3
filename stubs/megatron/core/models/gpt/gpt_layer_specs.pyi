from dataclasses import dataclass

from megatron.core.transformer import ModuleSpec, TransformerConfig

@dataclass
class TransformerBlockSubmodules:
    layer_specs: list[ModuleSpec] | None = None
    layer_norm: type | ModuleSpec | None = None

def get_gpt_layer_local_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool | None = False,
    qk_layernorm: bool | None = False,
    multi_latent_attention: bool | None = False,
    fp8: str | None = None,
    moe_use_legacy_grouped_gemm: bool | None = False,
    normalization: str | None = None,
) -> ModuleSpec: ...
def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: str | None = None,
) -> TransformerBlockSubmodules: ...
