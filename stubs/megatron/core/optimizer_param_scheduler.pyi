from typing import Any

from megatron.core.optimizer import MegatronOptimizer

class OptimizerParamScheduler:
    num_steps: int
    max_lr: float
    min_lr: float
    def __init__(
        self,
        optimizer: MegatronOptimizer,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: int,
        lr_decay_steps: int,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: int,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool | None = True,
        override_opt_param_scheduler: bool | None = False,
    ) -> None: ...
    def step(self, increment: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
