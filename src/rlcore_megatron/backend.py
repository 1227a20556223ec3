"""``MegatronBackend``: builds Megatron stacks from the planner's specs
(``rlcore.backend_api.Backend``).

Per rank: call it in every Megatron rank with the same spec (:mod:`rlcore.launch.ray.ranks` does
that for Ray actors). It initialises ``torch.distributed`` and Megatron's parallel state through
:func:`~rlcore_megatron.parallel.init_megatron` if the process has not already.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, final

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rlcore.algorithms.heap import release_freed_heap
from rlcore.errors import BackendUnavailableError, ConfigError, ConfigProblem, RLCoreError
from rlcore.specs import EvalSpec, LRSchedule, ModelSpec, OptimizerSpec, Precision, TrainSpec
from rlcore_megatron.model.arch import ModelArch, arch_from_hf_config, read_hf_config
from rlcore_megatron.model.gpt import build_gpt
from rlcore_megatron.model.hf_weights import load_hf_weights
from rlcore_megatron.options import MegatronOptions
from rlcore_megatron.parallel import device, init_megatron
from rlcore_megatron.stacks import MegatronEvalStack, MegatronTrainingStack

__all__ = [
    "MegatronBackend",
    "optimizer_config",
    "param_scheduler",
    "share_cpu_parameters",
    "use_fused_cpu_adam",
]


def optimizer_config(spec: OptimizerSpec, precision: Precision = "float32") -> OptimizerConfig:
    """Adam(W) for a model in ``precision``.

    In ``bfloat16`` Megatron builds its mixed-precision optimizer
    (``Float16OptimizerWithFloat16Params``, or the ``DistributedOptimizer`` when
    ``spec.distributed``): fp32 main weights and Adam state, gradients copied to fp32, bf16 model
    weights rewritten from the main weights after each step; no loss scaling (bf16 has fp32's
    range). ``min_lr`` is always set: Megatron's default ``None`` breaks the scheduler.
    ``clip_grad = 0`` ("off") becomes an infinite limit, so the grad norm is still computed and
    reported.
    """
    schedule = spec.schedule
    bf16 = precision == "bfloat16"
    return OptimizerConfig(
        optimizer="adam",
        lr=schedule.lr,
        min_lr=schedule.min_lr,
        weight_decay=spec.weight_decay,
        adam_beta1=spec.adam_beta1,
        adam_beta2=spec.adam_beta2,
        adam_eps=spec.adam_eps,
        clip_grad=spec.clip_grad if spec.clip_grad > 0 else float("inf"),
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=spec.distributed,
    )


def param_scheduler(
    optimizer: MegatronOptimizer, schedule: LRSchedule, weight_decay: float, override: bool = False
) -> OptimizerParamScheduler:
    """Megatron's scheduler for ``schedule``: warmup from 0 to ``lr``, then the decay style down
    to ``min_lr`` at ``decay_steps`` (the same curve as :meth:`LRSchedule.lr_at`). ``override``:
    loading a checkpoint keeps only its step count (Megatron's ``--override-opt_param-scheduler``,
    rlcore's ``LoadSpec(scheduler="flags")``)."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=schedule.lr,
        min_lr=schedule.min_lr,
        lr_warmup_steps=schedule.warmup_steps,
        lr_decay_steps=schedule.decay_steps,
        lr_decay_style=schedule.decay_style,
        start_wd=weight_decay,
        end_wd=weight_decay,
        wd_incr_steps=schedule.decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=not override,
        override_opt_param_scheduler=override,
    )


def use_fused_cpu_adam(optimizer: MegatronOptimizer) -> None:
    """Switch the CPU fallback optimizer to torch's fused AdamW kernel.

    Without Apex or Transformer Engine (always the case on the CPU) Megatron builds
    ``torch.optim.AdamW`` with neither ``fused`` nor ``foreach``, and torch then loops over the
    tensors one by one; the fused CPU kernel computes the same update several times faster. The
    flag is read at every step, so it can be set before the first one.
    """
    for group in optimizer.param_groups:
        group["fused"] = True
        group["foreach"] = False


TRIM_EVERY_BYTES = 64 * 2**20
"""How much parameter memory :func:`share_cpu_parameters` frees between two
:func:`~rlcore.algorithms.heap.release_freed_heap` calls: what its peak holds above the weights,
besides the tensor being moved."""


def share_cpu_parameters(model: torch.nn.Module) -> None:
    """Move a CPU model's parameters into shared memory (torch's ``file_system`` strategy, set
    for this process), before the optimizer or DDP hold them.

    Tensor-mode weight sync then hands a server on this machine handles to the live parameters
    (``rlcore_sglang.weight_sync.tensor.TensorSink``), as CUDA IPC handles do on GPUs, instead of
    first copying every tensor into a shared buffer: the server's copy into its own weights is the
    only one.

    The memory used stays that of the weights: each parameter is copied into a shared mapping and
    its heap memory freed, and glibc would keep those freed pages resident (nearly the weights a
    second time: all but the tensors over 32 MiB, about 3 of the 4 bytes per parameter of a 100M
    fp32 Llama, issue #23), so they are handed back to the system as the move goes
    (:func:`~rlcore.algorithms.heap.release_freed_heap`), together with what building the model
    freed (Megatron's fp32 initialisation copies).
    """
    import torch.multiprocessing

    # torch leaves set_sharing_strategy unannotated
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    release_freed_heap()
    freed = 0
    for param in model.parameters():
        freed += param.nbytes
        param.share_memory_()  # type: ignore[no-untyped-call]  # unannotated in torch
        if freed >= TRIM_EVERY_BYTES:
            release_freed_heap()
            freed = 0
    if freed:
        release_freed_heap()


@final
class MegatronBackend:
    """Builds :class:`MegatronTrainingStack` and :class:`MegatronEvalStack` on this rank.

    Weights come from ``ModelSpec.hf_checkpoint`` (an HF folder of a family that
    :mod:`rlcore_megatron.model.arch` supports). A spec without one gets a model built from
    ``hf_config`` (an HF ``config.json`` mapping) with seeded random weights. ``options``: the
    backend's settings (activation recompute), its defaults for ``None``.
    """

    def __init__(
        self, hf_config: Mapping[str, Any] | None = None, options: MegatronOptions | None = None
    ) -> None:
        self._hf_config = dict(hf_config) if hf_config is not None else None
        self._options = options if options is not None else MegatronOptions()

    def _arch(self, spec: ModelSpec) -> ModelArch:
        if spec.hf_checkpoint is not None:
            return read_hf_config(spec.hf_checkpoint)
        if self._hf_config is None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "model.hf_checkpoint",
                        "no HF checkpoint and no architecture to build",
                        "set ModelSpec.hf_checkpoint, or pass MegatronBackend(hf_config=...) "
                        "for random weights",
                    )
                ]
            )
        return arch_from_hf_config(self._hf_config, "MegatronBackend(hf_config=...)")

    def _model(self, spec: ModelSpec, train: bool) -> tuple[GPTModel, ModelArch]:
        """The model; with the options' activation recompute when it is for ``train``ing (an
        eval stack runs no backward, so a teacher of fewer layers is not refused)."""
        parallel = spec.parallel
        init_megatron(parallel.tensor, spec.seed, parallel.expert)
        world = torch.distributed.get_world_size()
        if world != spec.parallel.world_size:
            # The spec's split (TrainSpec's batch rule included) holds only for its own layout.
            raise BackendUnavailableError(
                f"ParallelSpec.world_size={spec.parallel.world_size} but this process is one of "
                f"{world} torch.distributed ranks: build the stack with the ParallelSpec of the "
                "ranks it runs on"
            )
        arch = self._arch(spec)
        options = self._options if train else MegatronOptions()
        layers_problem = options.num_layers_problem(arch.num_layers)
        if layers_problem is not None:
            raise ConfigError([layers_problem])
        model = build_gpt(
            arch, spec.role, device(), spec.moe_aux_loss_coeff, spec.precision, options
        )
        if device().type == "cpu":
            share_cpu_parameters(model)
        if spec.hf_checkpoint is not None:
            load_hf_weights(model, Path(spec.hf_checkpoint), arch, spec.role)
        return model, arch

    def build_eval_stack(self, spec: EvalSpec) -> MegatronEvalStack:
        try:
            model, arch = self._model(spec.model, train=False)
        except RLCoreError:
            raise
        except Exception as exc:  # Megatron internals: translated at the edge
            raise RLCoreError(
                f"building the Megatron eval stack for {spec.model.role} failed: {exc}"
            ) from exc
        model.requires_grad_(False)
        model.eval()
        return MegatronEvalStack(spec, model, arch, device())

    def build_training_stack(self, spec: TrainSpec) -> MegatronTrainingStack:
        try:
            gpt, arch = self._model(spec.model, train=True)
            ddp = DistributedDataParallel(
                config=gpt.config,
                ddp_config=DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True,  # bf16 too: gradients accumulate and reduce in fp32
                    overlap_grad_reduce=False,
                    use_distributed_optimizer=spec.optimizer.distributed,
                ),
                module=gpt,
            )
            optimizer = get_megatron_optimizer(
                optimizer_config(spec.optimizer, spec.model.precision), [ddp]
            )
            if not torch.cuda.is_available():
                use_fused_cpu_adam(optimizer)
            scheduler = param_scheduler(
                optimizer,
                spec.optimizer.schedule,
                spec.optimizer.weight_decay,
                override=spec.load.scheduler == "flags",
            )
        except RLCoreError:
            raise
        except Exception as exc:  # Megatron internals: translated at the edge
            raise RLCoreError(
                f"building the Megatron training stack for {spec.model.role} failed: {exc}"
            ) from exc
        return MegatronTrainingStack(spec, ddp, optimizer, scheduler, arch, device())
