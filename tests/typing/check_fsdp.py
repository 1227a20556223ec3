"""Read only by mypy (see check_protocols.py): the FSDP backend keeps the founding guarantee with
no new code in the core. Its eval stacks (the reference model, with LoRA a view of the actor's
base, an OPD teacher, eval-only's actor) have no optimizer or scheduler to reach; its training
stack has AdamW and its schedule."""

from __future__ import annotations

from typing import assert_type

import torch

from rlcore.backend_api import Backend, EvalStack, TrainingStack
from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore_fsdp.backend import FSDPBackend
from rlcore_fsdp.stacks import FSDPBaseView, FSDPEvalStack, FSDPTrainingStack


def it_is_a_backend(backend: FSDPBackend) -> Backend:
    return backend


def an_eval_stack_has_no_optimizer(backend: FSDPBackend) -> EvalStack:
    stack = backend.build_eval_stack(EvalSpec(ModelSpec("reference", None)))
    assert_type(stack, FSDPEvalStack | FSDPBaseView)
    _ = stack.optimizer  # type: ignore[union-attr]
    _ = stack.scheduler  # type: ignore[union-attr]
    _ = stack.train_step  # type: ignore[union-attr]
    return stack


def the_lora_reference_has_no_optimizer(view: FSDPBaseView) -> EvalStack:
    _ = view.optimizer  # type: ignore[attr-defined]
    return view


def an_eval_stack_is_no_training_stack(backend: FSDPBackend) -> TrainingStack:
    return backend.build_eval_stack(EvalSpec(ModelSpec("actor", None)))  # type: ignore[return-value]


def a_training_stack_has_its_optimizer(backend: FSDPBackend, spec: TrainSpec) -> TrainingStack:
    stack = backend.build_training_stack(spec)
    assert_type(stack, FSDPTrainingStack)
    assert_type(stack.optimizer, torch.optim.AdamW)
    assert_type(stack.scheduler, torch.optim.lr_scheduler.LambdaLR)
    return stack
