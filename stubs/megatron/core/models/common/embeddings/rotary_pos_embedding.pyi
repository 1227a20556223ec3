import torch

class RotaryEmbedding(torch.nn.Module):
    inv_freq: torch.Tensor
    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None: ...
    # Private in Megatron, but the one place that implements Llama 3's frequency scaling.
    def _apply_scaling(
        self,
        freqs: torch.Tensor,
        factor: float = 8,
        low_freq_factor: float = 1,
        high_freq_factor: float = 4,
        original_max_position_embeddings: int = 8192,
    ) -> torch.Tensor: ...
