"""Read only by mypy (see check_protocols.py): ``--bf16`` changes the model's dtype, not what an
eval stack can reach. Megatron's mixed-precision optimizer (where slime's eval-only crash lived)
is only reachable from a training spec and a training stack, as every optimizer is."""

from __future__ import annotations

from typing import assert_type

from megatron.core.optimizer import MegatronOptimizer

from rlcore.specs import EvalSpec, ModelSpec, TrainSpec
from rlcore_megatron.backend import MegatronBackend
from rlcore_megatron.stacks import MegatronEvalStack


def precision_is_a_closed_set() -> None:
    ModelSpec("actor", None, precision="bfloat16")
    ModelSpec("actor", None, precision="float16")  # type: ignore[arg-type]


def eval_specs_carry_no_optimizer_settings(spec: EvalSpec) -> None:
    _ = spec.optimizer  # type: ignore[attr-defined]


def a_bf16_eval_stack_has_no_optimizer(backend: MegatronBackend) -> None:
    stack = backend.build_eval_stack(EvalSpec(ModelSpec("actor", None, precision="bfloat16")))
    assert_type(stack, MegatronEvalStack)
    _ = stack.optimizer  # type: ignore[attr-defined]
    _ = stack.optimizer_info  # type: ignore[attr-defined]
    _ = stack.scheduler  # type: ignore[attr-defined]


def a_bf16_training_stack_has_its_optimizer(backend: MegatronBackend, spec: TrainSpec) -> None:
    stack = backend.build_training_stack(spec)
    assert_type(stack.optimizer, MegatronOptimizer)
    assert_type(stack.optimizer_info, dict[str, object])
