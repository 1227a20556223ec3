"""Checkpoints of one Megatron stack, in the folder the core loop hands to ``save``.

Layout of ``path`` (the loop writes it inside a temporary folder and moves ``latest`` last)::

    model/           dist_checkpointing of the model's sharded state dict
    optimizer/       dist_checkpointing of the optimizer state (training stacks only)
    scheduler.json   OptimizerParamScheduler.state_dict() (training stacks only)
    rollout.json     {"rollout_id": k, "model": {...}, "optimizer": {...}}; written last, after
                     every rank has finished

A folder without ``rollout.json`` is a half-written save and is refused as corrupt. ``model``
records the head (``lm`` or ``value``) and the architecture numbers, so a critic checkpoint is not
loaded into an actor (Megatron's loader would not notice: both heads are ``output_layer.weight``).
``optimizer`` records what shapes the optimizer state (the precision: in bf16 it holds the fp32
main weights; whether it is the distributed optimizer's per-rank shards), so training resumes only
into the same kind of optimizer; model weights load into either precision.
Every failure
raises :class:`~rlcore.errors.CheckpointError` naming the path; ranks that loaded different
rollout ids raise one too.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from torch.distributed.checkpoint.api import CheckpointException

from rlcore.algorithms.distributed import agree_on_rollout_id, barrier, rank
from rlcore.checkpoint_files import check_record_matches, read_stack_record, write_stack_record
from rlcore.errors import CheckpointError

__all__ = ["FORMAT", "load_checkpoint", "read_rollout_id", "save_checkpoint"]

FORMAT: Final = "rlcore-megatron/1"
OPTIMIZER_SHARDING: Final = {"distrib_optim_sharding_type": "dp_reshardable"}
"""How a distributed optimizer saves its state: each data-parallel rank writes its own shard of
the flat buffers, no gather (Megatron-LM's default). The other optimizers ignore it."""
LEGACY_OPTIMIZER_INFO: Final = {"precision": "float32", "distributed": False}
"""What a checkpoint without an ``optimizer`` record holds (the only optimizer there was)."""


def _require_psutil() -> None:
    # dist_checkpointing's saver hangs silently (no error, no progress) when psutil is missing.
    if importlib.util.find_spec("psutil") is None:
        raise CheckpointError(
            "saving a Megatron checkpoint needs psutil (without it dist_checkpointing hangs): "
            "pip install psutil"
        )


def save_checkpoint(
    path: Path,
    rollout_id: int,
    model: GPTModel,
    model_info: Mapping[str, object],
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    optimizer_info: Mapping[str, object] = LEGACY_OPTIMIZER_INFO,
) -> None:
    """Write the model (and optimizer and scheduler) state and ``rollout_id`` into ``path``.

    ``optimizer_info`` describes the optimizer (see the module docstring). Collective: every rank
    calls it with the same ``path`` (a shared file system).
    """
    _require_psutil()
    path = Path(path)
    try:
        if rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            (path / "model").mkdir(exist_ok=True)
            if optimizer is not None:
                (path / "optimizer").mkdir(exist_ok=True)
        barrier()
        model_sd = model.sharded_state_dict()
        # The optimizer's sharded state refers to the model's by tensor identity, and saving
        # rewrites a sharded state dict in place: derive it before the model is saved.
        optim_sd = (
            optimizer.sharded_state_dict(model_sd, metadata=dict(OPTIMIZER_SHARDING))
            if optimizer is not None
            else None
        )
        dist_checkpointing.save(model_sd, str(path / "model"))
        if optim_sd is not None:
            dist_checkpointing.save(optim_sd, str(path / "optimizer"))
        barrier()
        if rank() == 0:
            if scheduler is not None:
                (path / "scheduler.json").write_text(json.dumps(scheduler.state_dict()))
            meta = {
                "format": FORMAT,
                "rollout_id": rollout_id,
                "model": dict(model_info),
                "has_optimizer": optimizer is not None,
            }
            if optimizer is not None:
                meta["optimizer"] = dict(optimizer_info)
            write_stack_record(path, meta)
        barrier()
    except CheckpointError:
        raise
    except (
        Exception,
        CheckpointException,
    ) as exc:  # many kinds; the caller needs one, with the path
        raise CheckpointError(f"saving the checkpoint to {path} failed: {exc}") from exc


def read_rollout_id(path: Path) -> int:
    """The rollout id recorded in ``path``; ``CheckpointError`` when missing or half-written."""
    return int(_read_meta(path)["rollout_id"])


def _read_meta(path: Path) -> dict[str, Any]:
    return read_stack_record(path, FORMAT)


def _torch_adams(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam(W)s inside ``optimizer``: ``get_megatron_optimizer`` returns a
    ``ChainedOptimizer`` of parts, each wrapping its torch optimizer as ``.optimizer``."""
    parts: list[object] = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    inners = [getattr(part, "optimizer", None) for part in parts]
    return [inner for inner in inners if isinstance(inner, torch.optim.Adam | torch.optim.AdamW)]


# Megatron 0.16's distributed optimizer mishandles torch's Adam(W) (its fallback without
# Transformer Engine or Apex, so always on the CPU) when it loads a checkpoint into a fresh stack:
# it reads a per-parameter ``step`` that torch only creates at the first step (and asserts); it
# then gives every parameter the *same* step tensor, which torch increments once per parameter at
# each step; and its dp_reshardable loader copies into it a step captured before loading (0). The
# two functions below, run before and after loading, give it the state it expects and each
# parameter its own tensor holding the step it saved.


def _adam_step(value: float, param: torch.Tensor, group: Mapping[str, Any]) -> torch.Tensor:
    """A step counter as torch's Adam(W) makes it: 0-d float32, on the parameter's device when
    fused."""
    if group.get("fused"):
        return torch.full((), value, dtype=torch.float32, device=param.device)
    return torch.tensor(value, dtype=torch.float32)


def _allocate_torch_adam_state(optimizer: MegatronOptimizer) -> None:
    """Give torch's Adam(W) the state it creates at its first step (zero moments, step 0) if it
    has not stepped yet; loading overwrites all of it."""
    for inner in _torch_adams(optimizer):
        if inner.state:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param] = {
                    "step": _adam_step(0.0, param, group),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }


def _restore_torch_adam_steps(optimizer: MegatronOptimizer) -> None:
    """Give each parameter its own Adam ``step``: the one Megatron loaded into its param group."""
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            if "step" in group:
                for param in group["params"]:
                    inner.state[param]["step"] = _adam_step(float(group["step"]), param, group)


def load_checkpoint(
    path: Path,
    model: GPTModel,
    model_info: Mapping[str, object],
    optimizer: MegatronOptimizer | None = None,
    scheduler: OptimizerParamScheduler | None = None,
    optimizer_info: Mapping[str, object] = LEGACY_OPTIMIZER_INFO,
) -> int:
    """Restore what ``save_checkpoint`` wrote into the given objects; returns the rollout id.

    An eval stack passes only ``model`` (optimizer state in the folder is ignored). A training
    stack restoring from a weights-only checkpoint, or from another kind of optimizer
    (``optimizer_info``), is refused.
    """
    path = Path(path)
    meta = _read_meta(path)
    rollout_id = int(meta["rollout_id"])
    check_record_matches(
        path,
        meta.get("model", {}),
        model_info,
        "a different model",
        "load an actor checkpoint into an actor, a critic's into a critic",
    )
    agree_on_rollout_id(path, rollout_id)
    if optimizer is not None and not (path / "optimizer").is_dir():
        raise CheckpointError(f"checkpoint {path} has no optimizer state to resume training from")
    if optimizer is not None:
        check_record_matches(
            path,
            meta.get("optimizer", LEGACY_OPTIMIZER_INFO),
            optimizer_info,
            "the state of a different optimizer",
            "resume with the --bf16 and --use-distributed-optimizer settings that saved it; its "
            "model weights load into any precision, e.g. for --num-rollout 0",
        )
    try:
        model_sd = model.sharded_state_dict()
        if optimizer is not None:
            if optimizer.config.use_distributed_optimizer:
                _allocate_torch_adam_state(optimizer)
            optim_sd = optimizer.sharded_state_dict(
                model_sd, is_loading=True, metadata=dict(OPTIMIZER_SHARDING)
            )
        loaded = dist_checkpointing.load(model_sd, str(path / "model"))
        model.load_state_dict(loaded, strict=True)
        if optimizer is not None:
            optim_state = dist_checkpointing.load(optim_sd, str(path / "optimizer"))
            # The distributed optimizer copies into fp32 main-weight shards that are views of the
            # (fp32) parameters; Megatron's dp_reshardable loader does it with autograd on.
            with torch.no_grad():
                optimizer.load_state_dict(optim_state)
            if optimizer.config.use_distributed_optimizer:
                _restore_torch_adam_steps(optimizer)
        if scheduler is not None:
            scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    except CheckpointError:
        raise
    # A corrupt or mismatched folder surfaces as many Megatron/torch errors; torch's
    # CheckpointException derives from BaseException, not Exception.
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this model: {exc}") from exc
    return rollout_id
