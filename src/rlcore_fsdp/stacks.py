"""The FSDP stacks: :class:`FSDPEvalStack` (a sharded Hugging Face model),
:class:`FSDPTrainingStack` (that model, AdamW and the LR schedule, and the loss), and
:class:`FSDPBaseView` (a LoRA training stack's base model, its adapters disabled: the reference
without a second copy of the weights).

All score samples through :func:`score` (:func:`rlcore.algorithms.train_step.score_samples`,
every data-parallel rank running the same number of forward passes) and train through
the core's train-step arithmetic (:mod:`rlcore.algorithms.train_step`): every data-parallel rank
receives the whole rollout batch, trains on its own slice of each global batch with each
micro-batch's loss divided by the global batch's normaliser, and FSDP2's reduce-scatter sums
the gradients over the ranks (its default divides them by the world size; :func:`_sum_gradients`
asks for the sum), so the update is the global batch's aggregate whatever the split. The metrics
are all-reduced over the same ranks.

Weights leave as full tensors, gathered one at a time from their shards (``DTensor.full_tensor``,
a collective every rank takes part in; on one rank the parameters themselves, issue #36), under
the model's own Hugging Face names; a tied output embedding is sent once, under the input
embedding's name, as ``save_pretrained`` writes it.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, final

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlcore.algorithms.distributed import all_reduce_floats
from rlcore.engines.shared_tensors import ExportBuffers
from rlcore.samples import ForwardRows, Sample, TrainBatch, TrainMetrics
from rlcore.specs import EvalSpec, ModelSpec, Precision, TrainSpec
from rlcore.weights import NamedTensors, WeightSink, send_exported, takes_of
from rlcore_fsdp import checkpoint, lora
from rlcore_fsdp.options import model_record

if TYPE_CHECKING:
    from rlcore.algorithms.batching import TensorBatch

__all__ = [
    "FSDPBaseView",
    "FSDPEvalStack",
    "FSDPTrainingStack",
    "HFModel",
    "export_weights",
    "full_tensors",
    "model_output",
    "score",
]

HFModel = torch.nn.Module
"""A transformers ``PreTrainedModel`` (a causal LM, or a critic's token classifier), sharded."""

VIEW_WARNING: Final = "FSDP2-wrapped module .* returned a view tensor"
ADAPTER_FOLDER: Final = "adapter"
"""With LoRA, ``--save-hf`` writes the adapter folder (peft's) under this name in the export."""
DEFAULT_FORWARD_MICRO_BATCH = 16
"""Sequences per forward pass when scoring without gradients."""


def pad_id(config: Any) -> int:
    """The token that fills a batch's padding: the model's pad token, else 0 (padding is never
    attended to by a real token and never scored, so any id in the vocabulary does)."""
    found = getattr(config, "pad_token_id", None)
    return found if isinstance(found, int) else 0


def model_output(model: HFModel, tb: TensorBatch, is_critic: bool) -> torch.Tensor:
    """A policy's logits ``[B, T, V]`` at the positions that predict the response tokens
    (``tb.response_index``), or a critic's values ``[B, S]``, in fp32, from the model's own
    forward on the right-padded batch (with its attention mask).

    A policy's output head runs on those positions only (transformers' ``logits_to_keep``, per
    row; the model's own forward, so its final soft-capping and FSDP2's hooks on the root unit
    apply as to the full logits): no ``[B, S, V]`` logits, which with a vocabulary of 32k and
    more are as large as the whole decoder's activations (issue #36). Read them with
    ``at_response=True`` (:func:`rlcore.algorithms.batching.token_log_probs`)."""
    kwargs: dict[str, Any] = {} if is_critic else {"logits_to_keep": tb.response_index}
    with warnings.catch_warnings():
        # FSDP2 warns when a wrapped model returns a view (transformers' token classifiers do)
        # that an in-place op could break; nothing here changes the output in place.
        warnings.filterwarnings("ignore", VIEW_WARNING, UserWarning)
        out = model(
            input_ids=tb.tokens, attention_mask=tb.attention_mask, use_cache=False, **kwargs
        )
    logits: torch.Tensor = out.logits.float()
    return logits.squeeze(-1) if is_critic else logits


def score(
    model: HFModel,
    samples: Sequence[Sample],
    spec: ModelSpec,
    config: Any,
    device: torch.device,
    micro_batch: int,
    is_critic: bool,
) -> ForwardRows:
    """``samples`` scored by ``model`` (:func:`rlcore.algorithms.train_step.score_samples`). Each
    micro-batch's forward gathers the shards over the data-parallel ranks, so with several every
    rank must call this, with its own samples or none, and the ranks agree on one number of
    forward passes (the most any of them forms)."""
    from rlcore.algorithms.train_step import score_samples

    several = dist.is_initialized() and dist.get_world_size() > 1
    # the outermost FSDP unit (a peft model's is its base model): its gathered weights (the
    # embeddings and head) stay gathered after a forward, for the backward FSDP2 expects
    root = next(m for m in model.modules() if isinstance(m, FSDPModule))

    def output(tb: TensorBatch) -> torch.Tensor:
        out = model_output(model, tb, is_critic)
        # no backward follows: freed before the log-probs' transients are computed (issue #36)
        root.reshard()
        return out

    return score_samples(
        output,
        samples,
        spec,
        pad_id(config),
        device,
        micro_batch,
        all_reduce_floats(dist.ReduceOp.MAX) if several else None,
        at_response=not is_critic,
    )


def full_tensors(model: HFModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's state dict as full tensors, gathered one at a time (every rank must iterate
    them to the end); a tensor shared under two names (tied embeddings) once, under its first.

    On one rank a parameter's only shard is the full tensor: it is given as it is, a view of the
    live parameter (no gather, no copy; in shared memory on the CPU, so the embedded engine's
    sync maps it as Megatron's, issue #36), valid until the next step changes it."""
    seen: set[int] = set()
    # the parameters themselves (keep_vars): a tied weight is one object under both names
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        full = tensor
        if isinstance(tensor, DTensor):
            whole = tensor.device_mesh.size() == 1 and tensor.to_local().shape == tensor.shape
            full = tensor.to_local() if whole else tensor.full_tensor()
        yield name, full.detach()


def export_weights(
    model: HFModel,
    precision: Precision,
    gathered: Iterable[tuple[str, torch.Tensor]] | None = None,
    *,
    adapters: bool = True,
    buffers: ExportBuffers | None = None,
    cast: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights under the model's Hugging Face names (:func:`full_tensors`), in the
    dtype the model computes in (bf16 copies of the fp32 weights under ``bfloat16``); with LoRA,
    the base model's weights with the adapters merged in (:func:`rlcore_fsdp.lora.merged`), or
    without them (``adapters=False``, :func:`rlcore_fsdp.lora.unadapted`).
    ``gathered``: the model's :func:`full_tensors` when the caller has them already.
    ``buffers`` (a stack's, for its weight sinks): CPU bf16 copies are cast into them, in shared
    memory and rewritten by the next export, rather than into fresh tensors. ``cast=False`` (for
    sinks that cast as they copy, :attr:`rlcore.weights.Takes.any_dtype`): the fp32 weights."""
    dtype = torch.bfloat16 if precision == "bfloat16" and cast else None
    named = full_tensors(model) if gathered is None else gathered
    if lora.is_lora(model):
        named = lora.merged(model, named) if adapters else lora.unadapted(named)
    for name, full in named:
        if dtype is not None and full.is_floating_point():
            if buffers is None:
                full = full.to(dtype)
            else:
                full = buffers.materialise(name, full, tuple(full.shape), dtype)
        yield name, full


def _sum_gradients(model: HFModel) -> None:
    """Have FSDP2 sum the gradients over the data-parallel ranks instead of averaging them: each
    rank's loss is already divided by the global batch's normaliser. With plain ``SUM``
    collectives (a multiplication by the factor 1 after them): FSDP2 otherwise reduces with
    ``ReduceOp.AVG``, or ``PREMUL_SUM`` for a custom factor, and gloo implements neither."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


@final
class FSDPEvalStack:
    """A sharded model without gradients: no optimizer, no scheduler."""

    kind: Final = "eval"

    def __init__(self, spec: EvalSpec, model: HFModel, config: Any, device: torch.device) -> None:
        self._spec = spec
        self.model = model
        self.config = config
        self.device = device
        self.forward_micro_batch = DEFAULT_FORWARD_MICRO_BATCH
        self._export_buffers = ExportBuffers()

    @property
    def spec(self) -> ModelSpec:
        return self._spec.model

    def forward(self, samples: Sequence[Sample]) -> ForwardRows:
        is_critic = self.spec.role == "critic"
        return score(
            self.model,
            samples,
            self.spec,
            self.config,
            self.device,
            self.forward_micro_batch,
            is_critic,
        )

    def load(self, path: Path) -> int:
        record = model_record(self.config.to_dict(), self.spec.role)
        record["lora"] = lora.lora_record(self.model) if lora.is_lora(self.model) else None
        return checkpoint.load_checkpoint(path, self.model, record)

    def export_weights(self) -> NamedTensors:
        """The full weights under Hugging Face names (every rank must iterate them)."""
        return export_weights(self.model, self.spec.precision)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        weights = export_weights(
            self.model,
            self.spec.precision,
            buffers=self._export_buffers,
            cast=not takes_of(sinks).any_dtype,
        )
        send_exported(weights, sinks)


@final
class FSDPTrainingStack:
    """A sharded model with AdamW, its LR schedule and a loss (actor or critic)."""

    kind: Final = "train"

    def __init__(
        self,
        spec: TrainSpec,
        model: HFModel,
        config: Any,
        optimizer: torch.optim.AdamW,
        scheduler: torch.optim.lr_scheduler.LambdaLR,
        device: torch.device,
    ) -> None:
        self.train_spec = spec
        self.model = model
        self.config = config
        self._optimizer = optimizer
        self._scheduler = scheduler
        self.device = device
        self.forward_micro_batch = DEFAULT_FORWARD_MICRO_BATCH
        self._export_buffers = ExportBuffers()
        self._is_critic = spec.model.role == "critic"
        _sum_gradients(model)

    @property
    def spec(self) -> ModelSpec:
        return self.train_spec.model

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self._optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LambdaLR:
        return self._scheduler

    def forward(self, samples: Sequence[Sample]) -> ForwardRows:
        return score(
            self.model,
            samples,
            self.spec,
            self.config,
            self.device,
            self.forward_micro_batch,
            self._is_critic,
        )

    def export_weights(self) -> NamedTensors:
        """The full weights under Hugging Face names (every rank must iterate them)."""
        return export_weights(self.model, self.spec.precision)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        weights = export_weights(
            self.model,
            self.spec.precision,
            buffers=self._export_buffers,
            cast=not takes_of(sinks).any_dtype,
        )
        send_exported(weights, sinks)

    def _record(self) -> dict[str, object]:
        record = model_record(self.config.to_dict(), self.spec.role)
        # None without LoRA (a checkpoint saved before LoRA existed records none either)
        record["lora"] = lora.lora_record(self.model) if lora.is_lora(self.model) else None
        return record

    def save(self, path: Path, rollout_id: int) -> None:
        checkpoint.save_checkpoint(
            path, rollout_id, self.model, self._record(), self._optimizer, self._scheduler
        )

    def load(self, path: Path) -> int:
        """Restore ``path`` as the spec's :class:`~rlcore.specs.LoadSpec` says: the weights, and
        the optimizer state and the schedule's step unless told to start them afresh (with
        ``scheduler="flags"`` the spec's settings replace the restored ones)."""
        load = self.train_spec.load
        rollout_id = checkpoint.load_checkpoint(
            path,
            self.model,
            self._record(),
            self._optimizer if load.optimizer else None,
            self._scheduler if load.scheduler != "fresh" else None,
        )
        if load.scheduler == "flags":
            o = self.train_spec.optimizer
            self._scheduler.base_lrs = [o.schedule.lr for _ in self._optimizer.param_groups]
            for group in self._optimizer.param_groups:
                group["betas"] = (o.adam_beta1, o.adam_beta2)
                group["eps"] = o.adam_eps
                group["lr"] = o.schedule.lr_at(self._scheduler.last_epoch)
        return rollout_id

    def save_hf(self, folder: Path) -> None:
        """The model as a Hugging Face folder (:class:`~rlcore.protocols.stacks.HFExporter`):
        ``config.json`` as transformers writes it (its ``dtype`` the one the model computes in)
        and ``model.safetensors`` with the full weights in that dtype (a tied output embedding
        once, as ``save_pretrained`` writes it). Every rank calls it
        (the export gathers); rank 0 writes."""
        from safetensors.torch import save_file

        full = list(full_tensors(self.model))
        tensors = {
            name: t.to("cpu").contiguous()
            for name, t in export_weights(self.model, self.spec.precision, full)
        }
        adapter = lora.adapter_tensors(full) if lora.is_lora(self.model) else None
        if dist.get_rank() != 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        config = copy.deepcopy(self.config)
        config.dtype = "bfloat16" if self.spec.precision == "bfloat16" else "float32"
        config.save_pretrained(folder)
        if adapter is not None:
            lora.write_adapter(
                folder / ADAPTER_FOLDER, self.model, adapter, self.spec.hf_checkpoint
            )

    def train_step(self, batch: TrainBatch) -> TrainMetrics:
        from rlcore.algorithms.train_step import optimizer_steps

        return optimizer_steps(
            batch, self.train_spec, pad_id(self.config), self.device, self._optimizer_step
        )

    def _optimizer_step(self, global_batch: TensorBatch) -> TrainMetrics:
        from rlcore.algorithms.train_step import StepMetrics, micro_batch_loss, step_micro_batches

        step = StepMetrics(global_batch, self.train_spec.loss.agg_mode)
        self._optimizer.zero_grad()
        ranks, rank = dist.get_world_size(), dist.get_rank()
        micro_batches = step_micro_batches(global_batch, self.train_spec, rank, ranks)
        for mb in micro_batches:
            out = micro_batch_loss(
                model_output(self.model, mb, self._is_critic),
                mb,
                self.train_spec,
                at_response=not self._is_critic,
            )
            torch.autograd.backward(out.loss / step.normalizer)
            step.add(out)
        clip = self.train_spec.optimizer.clip_grad
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        lr = float(self._optimizer.param_groups[0]["lr"])
        self._optimizer.step()
        self._scheduler.step()
        if ranks > 1:
            means = step.reduce(
                all_reduce_floats(dist.ReduceOp.SUM), all_reduce_floats(dist.ReduceOp.MAX)
            )
        else:
            means = step.reduce()
        loss_value = means.pop("loss", 0.0)
        return TrainMetrics(
            loss=loss_value, grad_norm=grad_norm, lr=lr, tokens=step.tokens, extra=means
        )


@final
class FSDPBaseView:
    """The base model of a LoRA :class:`FSDPTrainingStack` (the actor), its adapters disabled
    (peft's ``disable_adapter``): an eval stack with no weights of its own, the reference under
    ``--lora-rank``. The base weights never train, so it is the model folder's model throughout;
    ``load`` checks a LoRA checkpoint and changes nothing
    (:func:`rlcore_fsdp.checkpoint.base_rollout_id`), and its weights leave as the base's."""

    kind: Final = "eval"

    def __init__(self, spec: EvalSpec, actor: FSDPTrainingStack) -> None:
        if not lora.is_lora(actor.model):
            raise ValueError(f"the {actor.spec.role}'s model carries no LoRA adapters to disable")
        self._spec = spec
        self._actor = actor
        self.forward_micro_batch = DEFAULT_FORWARD_MICRO_BATCH

    @property
    def spec(self) -> ModelSpec:
        return self._spec.model

    @property
    def model(self) -> HFModel:
        """The actor's (peft) model, whose base this stack computes with."""
        return self._actor.model

    def forward(self, samples: Sequence[Sample]) -> ForwardRows:
        actor = self._actor
        with lora.adapters_off(actor.model):
            return score(
                actor.model,
                samples,
                self.spec,
                actor.config,
                actor.device,
                self.forward_micro_batch,
                False,
            )

    def load(self, path: Path) -> int:
        record = model_record(self._actor.config.to_dict(), self.spec.role)
        return checkpoint.base_rollout_id(path, record)

    def export_weights(self) -> NamedTensors:
        """The base model's full weights under Hugging Face names (every rank must iterate
        them)."""
        return export_weights(self._actor.model, self.spec.precision, adapters=False)

    def send_weights(self, sinks: Sequence[WeightSink]) -> None:
        send_exported(self.export_weights(), sinks)
