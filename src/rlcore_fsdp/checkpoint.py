"""Checkpoints of one FSDP stack, in the folder the core loop hands to ``save``, with
``torch.distributed.checkpoint`` (DCP: each rank writes its own shards; a checkpoint loads into
another number of ranks).

Layout of ``path`` (the loop writes it inside a temporary folder and moves ``latest`` last)::

    model/           DCP of the model's state dict (with LoRA: the adapters only, the base
                     weights being the model folder's)
    optimizer/       DCP of the optimizer state (training stacks only)
    scheduler.json   the LR scheduler's state dict (training stacks only)
    rollout.json     {"rollout_id": k, "format": ..., "model": {...}}: the core's stack record
                     (:func:`rlcore.checkpoint_files.write_stack_record`), written last, after
                     every rank has finished

``model`` records the head (a critic's value head or the LM head) and the ``config.json``
numbers of the model, so a critic's checkpoint is not loaded into an actor, nor one of another
model. Every failure raises :class:`~rlcore.errors.CheckpointError` naming the path.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from rlcore.algorithms.distributed import agree_on_rollout_id, barrier, rank
from rlcore.checkpoint_files import check_record_matches, read_stack_record, write_stack_record
from rlcore.errors import CheckpointError
from rlcore_fsdp.lora import checkpointed, is_lora

__all__ = ["FORMAT", "base_rollout_id", "load_checkpoint", "save_checkpoint"]

FORMAT: Final = "rlcore-fsdp/1"


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """The model's state dict as DCP saves it; with LoRA, the entries of what trains only (the
    adapters, and a critic's value head: :func:`rlcore_fsdp.lora.checkpointed`)."""
    state = get_model_state_dict(model)
    if is_lora(model):
        held = checkpointed(model)
        state = {k: v for k, v in state.items() if held(k)}
    return state


def save_checkpoint(
    path: Path,
    rollout_id: int,
    model: torch.nn.Module,
    model_info: Mapping[str, object],
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> None:
    """Write the model (and optimizer and scheduler) state and ``rollout_id`` into ``path``.
    Collective: every rank calls it with the same ``path`` (a shared file system)."""
    path = Path(path)
    try:
        dcp_save(_model_state(model), checkpoint_id=path / "model")
        if optimizer is not None:
            optim_sd = get_optimizer_state_dict(model, optimizer)
            dcp_save(optim_sd, checkpoint_id=path / "optimizer")
        barrier()
        if rank() == 0:
            if scheduler is not None:
                (path / "scheduler.json").write_text(json.dumps(scheduler.state_dict()))
            record = {
                "format": FORMAT,
                "rollout_id": rollout_id,
                "model": dict(model_info),
                "has_optimizer": optimizer is not None,
            }
            write_stack_record(path, record)
        barrier()
    except (Exception, CheckpointException) as exc:  # many kinds; the caller needs one
        raise CheckpointError(f"saving the checkpoint to {path} failed: {exc}") from exc


def _checked_record(
    path: Path, model_info: Mapping[str, object], hint: str
) -> tuple[Mapping[str, Any], int]:
    """The model record and rollout id the checkpoint ``path`` holds, the record checked against
    ``model_info`` (``hint``: what to load instead)."""
    record = read_stack_record(path, FORMAT)
    saved = record.get("model", {})
    check_record_matches(path, saved, model_info, "a different model", hint)
    return saved, int(record["rollout_id"])


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    model_info: Mapping[str, object],
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> int:
    """Restore what :func:`save_checkpoint` wrote into the given objects; returns the rollout id.

    An eval stack passes only ``model`` (optimizer state in the folder is ignored); a training
    stack restoring from a weights-only checkpoint is refused."""
    path = Path(path)
    _, rollout_id = _checked_record(
        path,
        model_info,
        "load an actor checkpoint into an actor, a critic's into a critic, of the same model",
    )
    agree_on_rollout_id(path, rollout_id)
    if optimizer is not None and not (path / "optimizer").is_dir():
        raise CheckpointError(f"checkpoint {path} has no optimizer state to resume training from")
    try:
        model_sd = _model_state(model)
        dcp_load(model_sd, checkpoint_id=path / "model")
        # with LoRA the base weights stay the folder's (dcp_load has filled every entry it holds)
        lenient = StateDictOptions(strict=not is_lora(model))
        set_model_state_dict(model, model_sd, options=lenient)
        if optimizer is not None:
            optim_sd = get_optimizer_state_dict(model, optimizer)
            dcp_load(optim_sd, checkpoint_id=path / "optimizer")
            set_optimizer_state_dict(model, optimizer, optim_sd)
        if scheduler is not None:
            scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
            # The schedule's learning rate for the next step, also when the optimizer is fresh.
            groups = scheduler.optimizer.param_groups
            for group, lr in zip(groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
    # A corrupt or mismatched folder surfaces as many torch errors; torch's CheckpointException
    # derives from BaseException, not Exception.
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be loaded into this model: {exc}") from exc
    return rollout_id


def base_rollout_id(path: Path, model_info: Mapping[str, object]) -> int:
    """The rollout id of the LoRA checkpoint ``path``, for a stack that holds the base model of
    the adapters (the reference, a view of the actor's base): checked as a load checks it (the
    record against ``model_info``, the ranks agreeing), and nothing loaded, since the base weights
    under the adapters never train (they are the model folder's). A checkpoint of full weights
    is refused: its base moved, and the view cannot hold other weights than the actor's base."""
    path = Path(path)
    saved, rollout_id = _checked_record(path, model_info, "load a checkpoint of the same model")
    if saved.get("lora") is None:
        raise CheckpointError(
            f"checkpoint {path} holds full weights, not LoRA adapters: this stack is the base "
            "model of the LoRA actor (the model folder's weights, never trained) and takes no "
            "other weights; build it without LoRA to load them"
        )
    agree_on_rollout_id(path, rollout_id)
    return rollout_id
