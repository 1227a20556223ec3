"""``FSDPBackend``: builds FSDP2 stacks of any Hugging Face causal LM from the planner's specs
(``rlcore.backend_api.Backend``).

Per rank: call it on every data-parallel rank with the same spec (the launcher's Ray ranks do).
The model is ``AutoModelForCausalLM`` (a critic: ``AutoModelForTokenClassification`` with one
label, a value head over the same backbone, as verl builds it) from the spec's model folder, used
as it is, with fp32 weights, and sharded with ``torch.distributed.fsdp.fully_shard``: one unit
per decoder layer (the classes the model lists in ``_no_split_modules``) and the root. In
``bfloat16`` (``--bf16``) FSDP2's mixed-precision policy computes in bf16 (each unit's weights
cast as they are gathered) while the weights, their gradient reduction and AdamW stay fp32.
``--gradient-checkpointing`` recomputes each decoder layer's activations in the backward pass;
``--fsdp-cpu-offload`` keeps the weights, gradients and AdamW's state in CPU memory.
The weights go from the folder straight into the shards (:mod:`rlcore_fsdp.loading`: the model
built with its parameters on the meta device, sharded, then each rank reads its rows of each
tensor), so the build never holds a second copy of them; a folder whose tensors transformers
renames or converts on load is loaded with ``from_pretrained`` and then sharded, as before.
Every rank builds the same weights (the folder's, and seeded ones for a new value head, drawn as
``from_pretrained`` draws them), so no rank broadcasts. With ``--lora-rank N`` the actor (its
training and eval stacks) and the critic are wrapped with peft's LoRA adapters before sharding
(:mod:`rlcore_fsdp.lora`; the critic's value head trains in full beside its adapters); the
teacher is built without them. The reference is then the actor's base with the adapters disabled
(:class:`~rlcore_fsdp.stacks.FSDPBaseView`), no second copy of the weights: the backend that
built the LoRA actor's training stack returns that view for the reference (of the same model
folder, precision and layout), and the launcher builds the reference in the actor's ranks
(:attr:`rlcore.backends.BackendKind.model_owner`, :func:`rlcore_fsdp.options.model_owner`).
Asked for the reference before or without that actor, it builds the base model of its own.
Dropout is off (the model stays in eval mode): the loss is of the policy that sampled.
On the CPU a training stack's parameters' shards are moved into shared memory once built
(:func:`rlcore.engines.shared_tensors.share_cpu_tensors`, as Megatron's), so a weight sync to a
process on this machine hands over the live weights rather than copies.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any, final

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    apply_activation_checkpointing,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from rlcore.algorithms.distributed import device, init_process_group
from rlcore.engines.shared_tensors import share_cpu_tensors
from rlcore.errors import BackendUnavailableError, ConfigError, ConfigProblem, RLCoreError
from rlcore.specs import EvalSpec, ModelSpec, OptimizerSpec, ParallelSpec, Precision, TrainSpec
from rlcore_fsdp.loading import empty_model, fill, materialize_adapters, plain
from rlcore_fsdp.lora import add_adapters
from rlcore_fsdp.options import FSDPOptions, model_owner, parallel_problem
from rlcore_fsdp.stacks import FSDPBaseView, FSDPEvalStack, FSDPTrainingStack, HFModel

__all__ = ["FSDPBackend", "adamw", "init_rank", "local_shard", "lr_scheduler", "shard"]

_log = logging.getLogger("rlcore")


def init_rank(parallel: ParallelSpec, seed: int, offload: bool = False) -> None:
    """Join the data-parallel process group (gloo on the CPU, nccl on GPUs, and gloo beside it
    for the CPU tensors of ``offload``; one process of its own without a launcher) and seed
    torch, so that every rank builds the same weights. Refuses a split that FSDP does not make,
    and a process group of another size than ``parallel``."""
    problem = parallel_problem(parallel)
    if problem is not None:
        raise BackendUnavailableError(problem)
    init_process_group(cpu_collectives=offload)
    world = dist.get_world_size()
    if world != parallel.world_size:
        # The spec's split (TrainSpec's batch rule included) holds only for its own layout.
        raise BackendUnavailableError(
            f"ParallelSpec.world_size={parallel.world_size} but this process is one of {world} "
            "torch.distributed ranks: build the stack with the ParallelSpec of the ranks it "
            "runs on"
        )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def shard(
    model: torch.nn.Module,
    precision: Precision = "float32",
    checkpointing: bool = False,
    offload: bool = False,
) -> None:
    """FSDP2 over the default process group: each decoder layer (the module classes the model
    names in ``_no_split_modules``) a unit of its own, the rest (embeddings, final norm, head,
    tied or not) in the root's; in ``bfloat16``, computing in bf16 over fp32 weights and
    reducing gradients in fp32. ``checkpointing``: each decoder layer recomputes its activations
    in the backward pass (torch's non-reentrant checkpoint wrapper, which keeps the parameter
    names as they were). ``offload``: each rank's shards of the weights and their gradients live
    in CPU memory (so AdamW's state does too), copied to the device for each unit's use
    (``CPUOffloadPolicy``; pinned memory on GPUs)."""
    offload_policy = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    )
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bfloat16" else None,
        reduce_dtype=torch.float32,
    )
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())

    def is_layer(module: torch.nn.Module) -> bool:
        return module is not model and type(module).__name__ in layer_classes

    units: list[torch.nn.Module]
    if checkpointing:
        apply_activation_checkpointing(model, check_fn=is_layer)
        units = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    else:
        units = [m for m in model.modules() if is_layer(m)]
    for unit in units:
        fully_shard(unit, mp_policy=policy, offload_policy=offload_policy)
    fully_shard(model, mp_policy=policy, offload_policy=offload_policy)


def _config(folder: Path, options: FSDPOptions) -> Any:
    """The folder's config as transformers reads it; a :class:`ConfigError` naming the folder."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=options.trust_remote_code)
    except Exception as exc:  # transformers raises many kinds (OSError, ValueError, KeyError)
        hint = "point --hf-checkpoint at a Hugging Face model folder (config.json and weights)"
        if "trust_remote_code" in str(exc):
            hint = "the folder ships its own model code: pass --trust-remote-code if you trust it"
        raise ConfigError(
            [
                ConfigProblem(
                    "model.hf_checkpoint",
                    f"transformers cannot read the model folder {folder}: {exc}",
                    hint,
                )
            ]
        ) from exc


def _load(spec: ModelSpec, options: FSDPOptions) -> tuple[HFModel, Any]:
    if spec.hf_checkpoint is None:
        raise ConfigError(
            [
                ConfigProblem(
                    "model.hf_checkpoint",
                    "the fsdp backend builds its models from a Hugging Face folder; none is set",
                    "set --hf-checkpoint (ModelSpec.hf_checkpoint)",
                )
            ]
        )
    offload = options.fsdp_cpu_offload
    init_rank(spec.parallel, spec.seed, offload)
    folder = Path(spec.hf_checkpoint)
    config = _config(folder, options)
    from transformers.utils import logging as hf_logging

    # a progress bar per rank per stack says nothing; transformers leaves it unannotated
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    remote = options.trust_remote_code
    critic = spec.role == "critic"
    if critic:
        config.num_labels = 1  # one value per token
    lora = _adapted(options, spec)
    empty = empty_model(folder, config, critic, remote)
    top: HFModel | None = None
    if not isinstance(empty, str):
        empty[0].eval()
        top = empty[0]
        if lora:
            drawn = torch.random.get_rng_state()
            top = add_adapters(empty[0], options, critic)
            unreplayed = materialize_adapters(top, drawn)
            if unreplayed is not None:
                torch.random.set_rng_state(drawn)  # from_pretrained's path draws from here
                empty = unreplayed
    if isinstance(empty, str):
        # the weights as from_pretrained loads them, briefly twice over (module docstring)
        _log.info("loading %s with from_pretrained: %s", folder, empty)
        return _pretrained_shards(folder, config, spec, options), config
    assert top is not None
    model, checkpoint = empty
    # what the build made (a new head, adapters), kept for the shards; the rest is read
    kept = {plain(n): p for n, p in model.named_parameters() if not p.is_meta}
    shard(model, spec.precision, options.gradient_checkpointing, offload)
    fill(model, checkpoint, kept, "cpu" if offload else device())
    return top, config


def _adapted(options: FSDPOptions, spec: ModelSpec) -> bool:
    """Whether the model gets LoRA adapters: the actor's and the critic's with ``--lora-rank``;
    the reference and a teacher are the base model by design."""
    return options.lora_rank > 0 and spec.role in ("actor", "critic")


def _share_for_weight_sync(model: HFModel) -> None:
    """On the CPU, a training stack's parameters' shards into shared memory: weight sync to this
    machine then hands over the live shards, the full tensors on one rank
    (:mod:`rlcore.engines.shared_tensors`; #23 for the memory it frees). Not for eval stacks,
    whose weights are sent once if ever: moving them raised an eval-only bring-up's peak RSS by
    ~150 MiB at 100M parameters (issue #36's 0.45x target)."""
    if device().type == "cpu":
        share_cpu_tensors(local_shard(p) for p in model.parameters())


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (sharded) parameter, as a plain tensor (a view of its storage)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _pretrained_shards(folder: Path, config: Any, spec: ModelSpec, options: FSDPOptions) -> HFModel:
    """The model loaded by ``from_pretrained``, then (with LoRA adapters) sharded."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if spec.role == "critic" else AutoModelForCausalLM
    model: torch.nn.Module = auto.from_pretrained(
        folder, config=config, dtype=torch.float32, trust_remote_code=options.trust_remote_code
    )
    model.eval()
    offload, checkpointing = options.fsdp_cpu_offload, options.gradient_checkpointing
    if not offload:
        # offloaded, it stays in CPU memory: fully_shard moves one unit at a time to the device
        # to shard it, then the shards back
        model.to(device())
    if _adapted(options, spec):
        # the base model inside is sharded as it would be alone; the peft wrapper holds no weights
        adapted = add_adapters(model, options, spec.role == "critic")
        shard(adapted.get_base_model(), spec.precision, checkpointing, offload)
        return adapted
    shard(model, spec.precision, checkpointing, offload)
    return model


def adamw(model: torch.nn.Module, spec: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW as Megatron builds it from the same spec: weight decay on the matrices only (not on
    biases and norm weights, the one-dimensional parameters), the spec's betas and eps, the
    learning rate the schedule gives (set by :func:`lr_scheduler`)."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # LoRA: adapters
    decay = [p for n, p in trained if p.ndim > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in trained if p.ndim <= 1 or n.endswith(".bias")]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=spec.schedule.lr,
        betas=(spec.adam_beta1, spec.adam_beta2),
        eps=spec.adam_eps,
        # one kernel over all the tensors (CPU and GPU), as Megatron's fused Adam: torch's
        # default loops over them with a dozen foreach ops per step (#36)
        fused=True,
    )


def lr_scheduler(
    optimizer: torch.optim.Optimizer, spec: OptimizerSpec
) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning rate of :meth:`rlcore.specs.LRSchedule.lr_at` at each step (warmup from 0,
    then the decay style down to ``min_lr``), as Megatron's scheduler follows it."""
    schedule = spec.schedule
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: schedule.lr_at(step) / schedule.lr
    )


@final
class FSDPBackend:
    """Builds :class:`FSDPTrainingStack` and :class:`FSDPEvalStack` on this rank, and with LoRA
    the reference as :class:`FSDPBaseView` of the actor it built (module docstring)."""

    def __init__(self, options: FSDPOptions | None = None) -> None:
        self.options = options if options is not None else FSDPOptions()
        # the LoRA actor's training stack this backend built last (not kept alive by it)
        self._actor: weakref.ref[FSDPTrainingStack] | None = None

    def build_eval_stack(self, spec: EvalSpec) -> FSDPEvalStack | FSDPBaseView:
        actor = self._actor() if self._actor is not None else None
        if actor is not None and model_owner(self.options, spec) == actor.spec.role:
            same = ("hf_checkpoint", "parallel", "precision")
            if all(getattr(spec.model, f) == getattr(actor.spec, f) for f in same):
                return FSDPBaseView(spec, actor)
        try:
            model, config = _load(spec.model, self.options)
        except RLCoreError:
            raise
        except Exception as exc:  # transformers and torch internals: translated at the edge
            raise RLCoreError(
                f"building the fsdp eval stack for {spec.model.role} failed: {exc}"
            ) from exc
        model.requires_grad_(False)
        return FSDPEvalStack(spec, model, config, device())

    def build_training_stack(self, spec: TrainSpec) -> FSDPTrainingStack:
        try:
            model, config = _load(spec.model, self.options)
            _share_for_weight_sync(model)
            optimizer = adamw(model, spec.optimizer)
            scheduler = lr_scheduler(optimizer, spec.optimizer)
        except RLCoreError:
            raise
        except Exception as exc:  # transformers and torch internals: translated at the edge
            raise RLCoreError(
                f"building the fsdp training stack for {spec.model.role} failed: {exc}"
            ) from exc
        stack = FSDPTrainingStack(spec, model, config, optimizer, scheduler, device())
        if self.options.lora_rank > 0 and spec.model.role == "actor":
            self._actor = weakref.ref(stack)
        return stack
