from typing import Any

import torch
from megatron.core.transformer import TransformerConfig

class DistributedDataParallelConfig:
    def __init__(
        self,
        *,
        grad_reduce_in_fp32: bool = False,
        overlap_grad_reduce: bool = False,
        use_distributed_optimizer: bool = False,
    ) -> None: ...

class DistributedDataParallel(torch.nn.Module):
    module: torch.nn.Module
    def __init__(
        self,
        config: TransformerConfig,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
    ) -> None: ...
    def forward(self, *inputs: Any, **kwargs: Any) -> Any: ...
    def zero_grad_buffer(self) -> None: ...
    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None: ...

def finalize_model_grads(
    model: list[DistributedDataParallel],
    num_tokens: torch.Tensor | None = None,
) -> None: ...
