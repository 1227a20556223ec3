from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict

class OptimizerConfig:
    min_lr: float | None
    use_distributed_optimizer: bool
    def __init__(
        self,
        *,
        optimizer: str = "adam",
        lr: float | None = None,
        min_lr: float | None = None,
        weight_decay: float = 0.01,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_eps: float = 1e-08,
        clip_grad: float = 1.0,
        bf16: bool = False,
        fp16: bool = False,
        params_dtype: torch.dtype = torch.float32,
        use_distributed_optimizer: bool = False,
    ) -> None: ...

class MegatronOptimizer(ABC):
    config: OptimizerConfig
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimizerConfig,
        init_state_fn: Callable[..., Any] = ...,
    ) -> None: ...
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...
    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    # (update_successful, grad_norm, num_zeros_in_grad); the norm is None when not computed.
    @abstractmethod
    def step(self) -> tuple[bool, float | None, int | None]: ...
    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...
    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
    @abstractmethod
    def sharded_state_dict(
        self,
        model_sharded_state_dict: ShardedStateDict,
        is_loading: bool = False,
        metadata: dict[str, Any] | None = None,
    ) -> ShardedStateDict: ...

def get_megatron_optimizer(
    config: OptimizerConfig, model_chunks: list[torch.nn.Module]
) -> MegatronOptimizer: ...
