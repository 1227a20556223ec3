"""Run megatron-core 0.16 on the CPU over gloo when CUDA is absent: fp32 and bf16 mixed precision,
with or without the distributed optimizer, through Megatron's own code.

Megatron assumes a GPU in a handful of places on that path. Found on a CPU-only machine with
megatron-core 0.16.1:

- ``torch.cuda.current_device()`` as a tensor device: the attention scratch buffer
  (``utils.GlobalMemoryBuffer.get_tensor``), the RoPE frequencies (moved "to the GPU" on first
  use), the tensor-parallel gathers (``tensor_parallel.mappings``) and the sequence-parallel
  input gather in the linear layers' backward (``tensor_parallel.layers``), the DDP grad buffers
  (``distributed.param_and_grad_buffer``), the distributed optimizer's state allocation when it
  loads a checkpoint before its first step (``optimizer.distrib_optimizer``), the dist-ckpt save
  finalize (``dist_checkpointing.strategies.*``), the MoE router's weights (moved "to the GPU" on
  first use, ``transformer.moe.router``);
- literal ``device="cuda"`` tensors: the default causal mask (``transformer.utils``),
  ``FP32Optimizer._scale`` and the mixed-precision optimizer's unit loss scale
  (``optimizer.optimizer``), the grad-norm code (``optimizer.clip_grads``,
  ``utils.local_multi_tensor_l2_norm``), the MoE aux-loss tracker (``transformer.moe.moe_utils``);
- the ``param.grad.type() == 'torch.cuda.FloatTensor'`` assert in
  ``clip_grad_by_total_norm_fp32``;
- the mixed-precision optimizers sorting the model's parameters by CUDA type name: the
  constructors of ``Float16OptimizerWithFloat16Params`` (``--bf16``) and ``DistributedOptimizer``
  (``--use-distributed-optimizer``) compare ``param.type()`` with ``'torch.cuda.BFloat16Tensor'``
  / ``'torch.cuda.FloatTensor'`` and raise ``TypeError`` for anything else, so a CPU
  ``torch.BFloat16Tensor`` is refused;
- ``torch.cuda.synchronize()`` while saving a checkpoint;
- the CUDA RNG tracker (avoided in :func:`rlcore_megatron.parallel.init_megatron` with
  ``inference_rng_tracker=True``, which needs no CUDA generator);
- activation recompute (``tensor_parallel.random.CheckpointFunction``, behind
  ``--recompute-granularity``) saving and restoring the CUDA generator's state around the
  recomputed forward (``_get_cuda_rng_state``, ``_set_cuda_rng_state``): with no CUDA
  generator there is no state to keep, so they return an empty state and restore nothing (the
  CPU generator's state, which the CPU layers draw from, is still saved and restored by
  Megatron's code);
- CUDA streams and events in MoE's all-to-all token dispatcher (avoided: the model uses the
  all-gather dispatcher, Megatron's default, which has none).

Instead of patching ``torch`` for everyone, :func:`apply` gives exactly those Megatron modules a
``torch`` that maps CUDA devices to the CPU (``_CpuTorch``), replaces the one assert-bearing
function, and runs the two optimizer constructors with parameters that report the CUDA type name
of their dtype (``torch.cuda.BFloat16Tensor`` for a CPU bf16 parameter), only while the
constructor runs. Everything else in the process keeps the real ``torch``; the optimizers
themselves (main-weight copies, gradient copies, the step, the distributed optimizer's
reduce-scatter and all-gather, which gloo implements) are Megatron's code, unchanged, so the CPU
takes the path a GPU takes. It is applied only when CUDA is absent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import torch

__all__ = ["CPU_PATCHED_MODULES", "apply", "is_applied", "needed"]

CPU_PATCHED_MODULES: Final = (
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.utils",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.tensor_parallel.layers",
)
"""The Megatron modules whose global ``torch`` is replaced by :class:`_CpuTorch`."""

CUDA_TYPE_NAME_CONSTRUCTORS: Final = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
)
"""The Megatron classes whose ``__init__`` sees CUDA type names for CPU parameters."""

_CPU: Final = torch.device("cpu")
_applied = False


def needed() -> bool:
    """True when there is no CUDA device, i.e. when :func:`apply` must run before Megatron is
    used."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return _applied


def _cpu_device(device: object) -> object:
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    if isinstance(device, int):  # a CUDA ordinal
        return _CPU
    return device


def _on_cpu(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    make.__name__ = factory.__name__
    return make


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as the patched modules see it: the current device is the CPU, syncs are
    no-ops."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def synchronize(device: object = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


class _CpuTorch(types.ModuleType):
    """``torch`` as the patched modules see it: tensor factories put ``cuda`` tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in (
            "tensor",
            "zeros",
            "ones",
            "empty",
            "full",
            "arange",
            "zeros_like",
            "empty_like",
        ):
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        setattr(self, name, value)  # cache: later lookups skip __getattr__
        return value


def _clip_grad_by_total_norm_fp32(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    total_norm: float,
    use_decoupled_grad: bool = False,
) -> None:
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its ``torch.cuda.FloatTensor`` assert."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [g.detach() for p in params if (g := getattr(p, attr, None)) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``_get_cuda_rng_state`` without CUDA: an empty state (there is no CUDA generator)."""
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """``_set_cuda_rng_state`` without CUDA: nothing to restore."""
    del new_state


def _cuda_type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``Tensor.type()`` as a GPU would answer it: ``torch.BFloat16Tensor`` on the CPU reads
    ``torch.cuda.BFloat16Tensor``. With arguments (a cast) it is the real ``Tensor.type``."""
    result = torch.Tensor.type(self, *args, **kwargs)
    if args or kwargs or self.device.type != "cpu":
        return result
    return str(result).replace("torch.", "torch.cuda.", 1)


@contextlib.contextmanager
def _parameters_report_cuda_type_names() -> Iterator[None]:
    # ``Parameter`` inherits ``type`` from ``Tensor`` and defines none itself; setting it on the
    # class (not on ``Tensor``) and deleting it afterwards leaves every other tensor alone.
    torch.nn.Parameter.type = _cuda_type_name  # type: ignore[assignment, method-assign]  # scoped
    try:
        yield
    finally:
        del torch.nn.Parameter.type


def _with_cuda_type_names(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def constructor(self: object, *args: Any, **kwargs: Any) -> None:
        with _parameters_report_cuda_type_names():
            init(self, *args, **kwargs)

    return constructor


def apply() -> None:
    """Redirect Megatron's CUDA-only spots to the CPU. Idempotent; a no-op when CUDA is present."""
    global _applied
    if _applied or not needed():
        return
    cpu_torch = _CpuTorch()
    for name in CPU_PATCHED_MODULES:
        module = importlib.import_module(name)
        module.torch = cpu_torch  # type: ignore[attr-defined]  # the module's own global
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    # Replaced in the defining module and in optimizer.py, which imported it by name.
    # The stubs declare neither module attribute: we set them on purpose.
    clip_grads.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32  # type: ignore[attr-defined]
    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32  # type: ignore[attr-defined]
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _no_cuda_rng_state  # type: ignore[attr-defined]  # private, on purpose
    random._set_cuda_rng_state = _set_no_cuda_rng_state  # type: ignore[attr-defined]  # private, on purpose
    for module_name, class_name in CUDA_TYPE_NAME_CONSTRUCTORS:
        cls = getattr(importlib.import_module(module_name), class_name)
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    _applied = True
