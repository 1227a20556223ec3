import torch

class RotaryEmbedding(torch.nn.Module):
    inv_freq: torch.Tensor
    # Private in Megatron, but the one place that implements Llama 3's frequency scaling.
    def _apply_scaling(
        self,
        freqs: torch.Tensor,
        factor: float = 8,
        low_freq_factor: float = 1,
        high_freq_factor: float = 4,
        original_max_position_embeddings: int = 8192,
    ) -> torch.Tensor: ...
