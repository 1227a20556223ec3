"""The MoE router's load-balancing loss in a training step: its gradient scale and its metric.

Megatron adds the loss (Switch Transformer, Fedus et al. 2021, eq. 4: ``coeff * E *
sum_e f_e * P_e`` per sparse layer, over ``E`` experts, ``f_e`` the share of the top-k slots
routed to expert ``e`` and ``P_e`` its mean router probability, over the real tokens: the stacks
pass Megatron a padding mask) inside the router, through ``MoEAuxLossAutoScaler``, so it never
appears in the loss the stack computes. With ``calculate_per_token_loss`` Megatron multiplies it
by the router's token count and expects the gradients to be divided by the batch's token count
later; the stacks instead divide each micro-batch's loss by the global batch size, so
:func:`set_aux_loss_scale` gives the router the matching scale: each micro-batch's aux loss then
weighs ``micro-batch size / global batch size``, like its policy loss.

:func:`fix_router` mends two defects of megatron-core 0.16.1's router that the stacks would
otherwise hit, on GPUs as on the CPU.

The loss values are collected by Megatron's layer-wise tracker; :func:`pop_load_balancing_loss`
reduces them over ranks and returns their mean over sparse layers and micro-batches, the number
Megatron-LM logs as ``load_balancing_loss``.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

import torch

from rlcore_megatron.model.arch import ModelArch

__all__ = [
    "LOAD_BALANCING_LOSS",
    "discard_load_balancing_loss",
    "fix_router",
    "pop_load_balancing_loss",
    "set_aux_loss_scale",
]

LOAD_BALANCING_LOSS: Final = "load_balancing_loss"
"""Megatron's tracker name for the router's aux loss (and the metric's name here)."""


def _moe_utils() -> Any:
    return importlib.import_module("megatron.core.transformer.moe.moe_utils")


def _token_counts(
    routing_map: torch.Tensor,
    reduce_group: torch.distributed.ProcessGroup,
    topk: int | None = None,
    with_padding_mask: bool = False,
) -> tuple[torch.Tensor, int | torch.Tensor, int | torch.Tensor]:
    """megatron-core 0.16.1's ``get_tokens_per_expert_and_token_count`` with the reduction on a
    copy: the original all-reduces ``local_tokens_per_expert`` in place over the TP group, so with
    a padding mask under sequence parallelism its "local" token count is the whole group's, and
    the aux-loss gradient comes out TP-size times too large. ``routing_map`` is
    ``[tokens, experts]``; returns the experts' token counts over the group, this rank's token
    count and the group's."""
    tensor_parallel = importlib.import_module("megatron.core.tensor_parallel")
    local_tokens_per_expert = routing_map.sum(dim=0)
    global_tokens_per_expert = tensor_parallel.reduce_from_tensor_model_parallel_region(
        local_tokens_per_expert.clone(), reduce_group
    )
    if with_padding_mask:
        assert topk is not None
        return (
            global_tokens_per_expert,
            local_tokens_per_expert.sum() / topk,
            global_tokens_per_expert.sum() / topk,
        )
    local_num_tokens = routing_map.shape[0]
    return global_tokens_per_expert, local_num_tokens, local_num_tokens * reduce_group.size()


def fix_router() -> None:
    """Mend megatron-core 0.16.1's MoE router (idempotent), wherever it runs:

    - the router's matmul tests ``te_general_gemm is not None``, a name that exists only when
      Transformer Engine imported (else a ``NameError``): define it as the missing-TE fallback
      intends, so that the router takes its ``torch.mm`` path;
    - its token counts alias the all-reduce (:func:`_token_counts`): the router module, which
      imported the function by name, gets the corrected one.
    """
    moe_utils = _moe_utils()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    router = importlib.import_module("megatron.core.transformer.moe.router")
    # The stubs do not declare this module attribute: it is replaced on purpose.
    router.get_tokens_per_expert_and_token_count = _token_counts  # type: ignore[attr-defined]


def set_aux_loss_scale(micro_batch: int, global_batch: int, router_tokens: int) -> None:
    """Before a micro-batch's backward: the router's aux-loss gradient becomes
    ``coeff * aux / global_batch * micro_batch`` (Megatron multiplied it by ``router_tokens``,
    the real tokens this rank routes: see :func:`rlcore_megatron.stacks.routed_tokens`)."""
    scale = micro_batch / (global_batch * router_tokens)
    _moe_utils().MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))


def pop_load_balancing_loss(arch: ModelArch, micro_batches: int) -> float | None:
    """The load-balancing loss of the step just taken (``None`` when the router computed none),
    averaged over sparse layers and this rank's ``micro_batches``, summed over the TP ranks'
    sequence shards and averaged over data parallel; the tracker is cleared for the next step."""
    moe_utils = _moe_utils()
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if arch.moe is None or LOAD_BALANCING_LOSS not in tracker:
        return None
    moe_utils.reduce_aux_losses_tracker_across_ranks([LOAD_BALANCING_LOSS])
    values: torch.Tensor = tracker[LOAD_BALANCING_LOSS]["values"]
    sparse = torch.tensor(arch.moe.moe_layers, dtype=torch.bool, device=values.device)
    loss = float(values[sparse].sum()) / (int(sparse.sum()) * max(micro_batches, 1))
    discard_load_balancing_loss()
    return loss


def discard_load_balancing_loss() -> None:
    """Forget what the router's tracker holds of the load-balancing loss.

    Megatron's own ``clear_aux_losses_tracker`` only zeroes the values and keeps the entry (sized
    for the model that made it), so a later stack of the same process, even one that computes no
    such loss (``moe_aux_loss_coeff`` 0) or has another number of layers, would find it: removed
    instead, so that an entry means "computed in this step".
    """
    _moe_utils().get_moe_layer_wise_logging_tracker().pop(LOAD_BALANCING_LOSS, None)
