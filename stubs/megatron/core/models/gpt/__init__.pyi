from typing import Literal

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import TransformerBlockSubmodules
from megatron.core.transformer import ModuleSpec, TransformerConfig

class GPTModel(torch.nn.Module):
    config: TransformerConfig
    output_layer: torch.nn.Module
    rotary_pos_emb: RotaryEmbedding
    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec | TransformerBlockSubmodules,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal[
            "learned_absolute", "rope", "mrope", "yarn", "none"
        ] = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
    ) -> None: ...
    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *,
        padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor: ...
    def sharded_state_dict(self, prefix: str = "") -> ShardedStateDict: ...
