"""The Megatron stacks: :class:`MegatronEvalStack` (a model) and :class:`MegatronTrainingStack`
(a model in Megatron DDP, its optimizer and LR scheduler, and a loss).

Both score samples the same way (:func:`score_samples`). Every data-parallel rank calls
``train_step`` with the *same* whole rollout batch and takes its own slice of each global batch;
each micro-batch's loss numerator is divided by the *global* batch's normaliser
(:func:`rlcore.algorithms.losses.loss_normalizer`: its sequence count, or its token count for
``token-mean``; every rank computes it from the whole global batch, so no collective is needed) and
DDP sums the gradients (``calculate_per_token_loss``), so the update is the global aggregate
whatever the micro-batch and data-parallel split, in every aggregation mode.

Precision: a bf16 model's logits (or values) are upcast to fp32 as they leave it (what Megatron's
``Float16Module`` does), so log-probs, losses and metrics are computed in fp32 whatever the
model's precision.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final, final

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rlcore.algorithms.distributed import all_reduce_floats
from rlcore.engines.shared_tensors import ExportBuffers
from rlcore.samples import ForwardRows, Sample, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, Role, TrainSpec
from rlcore.weights import NamedTensors, WeightSink, send_exported, takes_of
from rlcore_megatron import checkpoint
from rlcore_megatron.model import moe
from rlcore_megatron.model.arch import ModelArch, model_info
from rlcore_megatron.model.gpt import uses_sequence_parallel
from rlcore_megatron.model.hf_weights import export_hf_weights, save_hf

if TYPE_CHECKING:
    from rlcore.algorithms.batching import TensorBatch
    from rlcore.algorithms.losses import LossOut

__all__ = [
    "MegatronEvalStack",
    "MegatronTrainingStack",
    "model_info",
    "model_output",
    "routed_tokens",
    "score_samples",
    "sequence_multiple",
    "send_exported",
]

DEFAULT_FORWARD_MICRO_BATCH = 16
"""Sequences per forward pass when scoring without gradients."""


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    seq = tokens.shape[1]
    return torch.arange(seq, device=tokens.device).unsqueeze(0).expand(tokens.shape[0], seq)


@functools.lru_cache(maxsize=8)
def causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    """``[seq, seq]``, True above the diagonal (the positions a token must not attend to): the
    mask Megatron's attention softmax builds for itself (``get_default_causal_mask``) in every
    layer of every forward when given none, built here once per length and device and passed
    to the model (issue #38)."""
    return torch.triu(torch.ones(seq, seq, device=device), diagonal=1).bool()


def sequence_multiple(arch: ModelArch) -> int:
    """Sequence parallelism splits the sequence over the TP ranks: its length must divide."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return tp if uses_sequence_parallel(arch, tp) else 1


def model_output(
    model: torch.nn.Module, tb: TensorBatch, arch: ModelArch, is_critic: bool
) -> torch.Tensor:
    """Logits ``[B, S, V]`` of a policy, or values ``[B, S]`` of a critic, for ``tb.tokens``, in
    fp32 whatever the model's precision.

    Batches are right-padded, so the causal mask alone keeps padding out of every real token's
    context (:func:`causal_mask`, no padding mask); under sequence parallelism more padding makes
    the length a multiple of the TP size, and is cut off again.
    """
    tokens, real = tb.tokens, tb.attention_mask.bool()
    seq = tokens.shape[1]
    extra = -seq % sequence_multiple(arch)
    if extra:
        tokens = F.pad(tokens, (0, extra), value=arch.pad_token_id)
        real = F.pad(real, (0, extra), value=False)
    # The MoE router leaves padding out of its load-balancing loss (True marks padding).
    moe_kwargs = {"padding_mask": ~real} if arch.moe is not None else {}
    mask = causal_mask(tokens.shape[1], tokens.device)
    out: torch.Tensor = model(tokens, _positions(tokens), mask, **moe_kwargs).float()
    out = out[:, :seq]
    if is_critic:
        return out.squeeze(-1)
    if out.shape[-1] != arch.vocab_size:  # vocabulary padded for tensor parallelism
        out = out[..., : arch.vocab_size]
    return out


def routed_tokens(arch: ModelArch, attention_mask: torch.Tensor) -> int:
    """The real (not padding) tokens that this rank's MoE routers see in a micro-batch with
    ``attention_mask`` ``[B, S]``: all of them, or under sequence parallelism this TP rank's
    contiguous share of the positions."""
    split = sequence_multiple(arch)
    mask = attention_mask.bool()
    if split > 1:
        mask = F.pad(mask, (0, -mask.shape[1] % split), value=False)
        chunk = mask.shape[1] // split
        rank = parallel_state.get_tensor_model_parallel_rank()
        mask = mask[:, rank * chunk : (rank + 1) * chunk]
    return int(mask.sum())


def _send_weights(
    model: torch.nn.Module,
    arch: ModelArch,
    role: Role,
    buffers: ExportBuffers,
    sinks: Sequence[WeightSink],
) -> None:
    """Export ``model``'s weights under Hugging Face names into the stack's ``buffers`` and hand
    them to ``sinks``; q/k/v as row blocks of the fused QKV where every sink takes them
    (:attr:`rlcore.weights.Takes.row_blocks`)."""
    weights = export_hf_weights(model, arch, role, buffers, blocks=takes_of(sinks).row_blocks)
    send_exported(weights, sinks)


def score_samples(
    model: torch.nn.Module,
    samples: Sequence[Sample],
    arch: ModelArch,
    spec: ModelSpec,
    device: torch.device,
    micro_batch: int = DEFAULT_FORWARD_MICRO_BATCH,
) -> ForwardRows:
    """Per response token: log-probs at ``spec.temperature`` (a policy) or values (a critic),
    one tuple per sample, with the positions it ran
    (:func:`rlcore.algorithms.train_step.score_samples`)."""
    from rlcore.algorithms import train_step

    is_critic = spec.role == "critic"
    return train_step.score_samples(
        lambda tb: model_output(model, tb, arch, is_critic),
        samples,
        spec,
        arch.pad_token_id,
        device,
        micro_batch,
    )


@final
class MegatronEvalStack:
    """A model in eval mode, without gradients: no DDP buffers, no optimizer, no scheduler."""

    kind: Final = "eval"

    def __init__(
        self, spec: EvalSpec, model: GPTModel, arch: ModelArch, device: torch.device
    ) -> None:
        self._spec = spec
        self.model = model
        self.arch = arch
        self.device = device
        self.forward_micro_batch = DEFAULT_FORWARD_MICRO_BATCH
        self._export_buffers = ExportBuffers()

    @property
    def spec(self) -> ModelSpec:
        return self._spec.model

    def forward(self, samples: Sequence[Sample]) -> ForwardRows:
        return score_samples(
            self.model, samples, self.arch, self.spec, self.device, self.forward_micro_batch
        )

    def load(self, path: Path) -> int:
        return checkpoint.load_checkpoint(path, self.model, model_info(self.arch, self.spec.role))

    def export_weights(self) -> NamedTensors:
        """The full weights under HF names, gathered over tensor parallel (every TP rank must
        iterate them)."""
        return export_hf_weights(self.model, self.arch, self.spec.role)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        _send_weights(self.model, self.arch, self.spec.role, self._export_buffers, sinks)


@final
class MegatronTrainingStack:
    """A model in Megatron DDP with its optimizer, LR scheduler and loss (actor or critic)."""

    kind: Final = "train"

    def __init__(
        self,
        spec: TrainSpec,
        model: DistributedDataParallel,
        optimizer: MegatronOptimizer,
        scheduler: OptimizerParamScheduler,
        arch: ModelArch,
        device: torch.device,
    ) -> None:
        if not isinstance(model.module, GPTModel):
            raise TypeError(
                f"MegatronTrainingStack needs DDP around a GPTModel, got {type(model.module)}"
            )
        self.train_spec = spec
        self.model = model
        self._gpt = model.module
        self._optimizer = optimizer
        self._scheduler = scheduler
        self.arch = arch
        self.device = device
        self.forward_micro_batch = DEFAULT_FORWARD_MICRO_BATCH
        self._is_critic = spec.model.role == "critic"
        self._export_buffers = ExportBuffers()

    @property
    def spec(self) -> ModelSpec:
        return self.train_spec.model

    @property
    def optimizer(self) -> MegatronOptimizer:
        return self._optimizer

    @property
    def scheduler(self) -> OptimizerParamScheduler:
        return self._scheduler

    @property
    def gpt(self) -> GPTModel:
        """The model inside DDP."""
        return self._gpt

    @property
    def optimizer_info(self) -> dict[str, object]:
        """What a checkpoint records about the optimizer, checked when training resumes."""
        return {
            "precision": self.spec.precision,
            "distributed": self.train_spec.optimizer.distributed,
        }

    def forward(self, samples: Sequence[Sample]) -> ForwardRows:
        return score_samples(
            self.gpt, samples, self.arch, self.spec, self.device, self.forward_micro_batch
        )

    def export_weights(self) -> NamedTensors:
        """The full weights under HF names, gathered over tensor parallel (every TP rank must
        iterate them)."""
        return export_hf_weights(self.gpt, self.arch, self.spec.role)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        _send_weights(self.gpt, self.arch, self.spec.role, self._export_buffers, sinks)

    def load(self, path: Path) -> int:
        """Restore ``path`` as the spec's :class:`~rlcore.specs.LoadSpec` says: the weights, and
        the optimizer state and the schedule unless told to start them afresh (with
        ``scheduler="flags"`` the scheduler was built to keep only the checkpoint's step, and the
        optimizer's settings are set from the spec again over what its state restored)."""
        load = self.train_spec.load
        info = model_info(self.arch, self.spec.role)
        rollout_id = checkpoint.load_checkpoint(
            path,
            self.gpt,
            info,
            self._optimizer if load.optimizer else None,
            self._scheduler if load.scheduler != "fresh" else None,
            self.optimizer_info,
        )
        if load.scheduler != "fresh":
            self._agree_with_schedule(flags=load.scheduler == "flags")
        return rollout_id

    def _agree_with_schedule(self, flags: bool) -> None:
        """Make the optimizer's param groups follow the schedule in force after a load: the
        spec's (``flags``) or the checkpoint's. Megatron's scheduler prefers a group's own
        ``max_lr``/``min_lr`` to its own values, and loading the optimizer's state restores the
        saved ones (a fresh optimizer has the spec's): without this the schedule in force would
        be a mix. With ``flags`` the spec's betas and eps replace the restored ones too."""
        o = self.train_spec.optimizer
        if flags:
            max_lr, min_lr = o.schedule.lr, o.schedule.min_lr
        else:
            max_lr, min_lr = self._scheduler.max_lr, self._scheduler.min_lr
        for group in self._optimizer.param_groups:
            if "max_lr" in group:
                group["max_lr"] = max_lr
            if "min_lr" in group:
                group["min_lr"] = min_lr
            if flags:
                group["betas"] = (o.adam_beta1, o.adam_beta2)
                group["eps"] = o.adam_eps
        self._scheduler.step(increment=0)  # this step's learning rate, from the above

    def save_hf(self, folder: Path) -> None:
        """The model as a Hugging Face folder (:class:`~rlcore.protocols.stacks.HFExporter`), in the
        dtype it trains in. Every rank calls it (the export gathers over tensor and expert
        parallel); rank 0 writes."""
        save_hf(self, folder, self.arch)

    def save(self, path: Path, rollout_id: int) -> None:
        info = model_info(self.arch, self.spec.role)
        checkpoint.save_checkpoint(
            path,
            rollout_id,
            self.gpt,
            info,
            self._optimizer,
            self._scheduler,
            self.optimizer_info,
        )

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        from rlcore.algorithms.train_step import optimizer_steps

        return optimizer_steps(
            batch, self.train_spec, self.arch.pad_token_id, self.device, self._optimizer_step
        )

    def _micro_loss(self, mb: TensorBatch) -> LossOut:
        from rlcore.algorithms.train_step import micro_batch_loss

        out = model_output(self.model, mb, self.arch, self._is_critic)
        return micro_batch_loss(out, mb, self.train_spec)

    def _optimizer_step(self, global_batch: TensorBatch) -> TrainMetrics:
        from rlcore.algorithms.train_step import StepMetrics, step_micro_batches

        step = StepMetrics(global_batch, self.train_spec.loss.agg_mode)
        self.model.train()
        self.model.zero_grad_buffer()
        self._optimizer.zero_grad()
        if self.arch.moe is not None:  # what an interrupted step left in the router's tracker
            moe.discard_load_balancing_loss()
        micro_batches = step_micro_batches(
            global_batch,
            self.train_spec,
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
        )
        for mb in micro_batches:
            if self.arch.moe is not None:
                # The router's aux loss is a per-sequence mean, whatever --loss-agg-mode says.
                routed = routed_tokens(self.arch, mb.attention_mask)
                moe.set_aux_loss_scale(mb.num_sequences, global_batch.num_sequences, max(routed, 1))
            out = self._micro_loss(mb)
            torch.autograd.backward(out.loss / step.normalizer)
            step.add(out)
        # DP gradient reduction, and the TP all-reduce of replicated weights that see only their
        # rank's heads (QK-norms) or sequence shard (sequence parallelism).
        finalize_model_grads([self.model])
        lr = float(self._optimizer.param_groups[0]["lr"])
        ok, grad_norm, _ = self._optimizer.step()
        self._scheduler.step(increment=1)
        balance = moe.pop_load_balancing_loss(self.arch, len(micro_batches))
        if parallel_state.get_data_parallel_world_size() > 1:
            dp = parallel_state.get_data_parallel_group()
            means = step.reduce(
                all_reduce_floats(dist.ReduceOp.SUM, dp), all_reduce_floats(dist.ReduceOp.MAX, dp)
            )
        else:
            means = step.reduce()
        loss_value = means.pop("loss", 0.0)
        if not ok:
            means["skipped_step"] = 1.0
        if balance is not None:
            means[moe.LOAD_BALANCING_LOSS] = balance
        return TrainMetrics(
            loss=loss_value,
            grad_norm=float(grad_norm) if grad_norm is not None else 0.0,
            lr=lr,
            tokens=step.tokens,
            extra=means,
        )
