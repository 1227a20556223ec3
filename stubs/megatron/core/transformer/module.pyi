from typing import Any

import torch
from megatron.core.transformer import TransformerConfig

class Float16Module(torch.nn.Module):
    config: TransformerConfig
    module: torch.nn.Module
    def __init__(self, config: TransformerConfig, module: torch.nn.Module) -> None: ...
    def forward(self, *inputs: Any, fp32_output: bool = True, **kwargs: Any) -> Any: ...
