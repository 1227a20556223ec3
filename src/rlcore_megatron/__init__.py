"""The Megatron backend for rlcore: Megatron-core stacks, HF <-> Megatron weights, the CPU shim.

``import rlcore_megatron`` is light (a Ray driver imports it without megatron); the names below
import their module on first use.

- :class:`MegatronBackend` (``rlcore.Backend``) builds :class:`MegatronTrainingStack` and
  :class:`MegatronEvalStack` on this rank.
- :func:`init_megatron` initialises ``torch.distributed`` and Megatron's parallel state,
  idempotently.
- :func:`save_hf` writes an HF checkpoint from a stack or from ``(hf_name, tensor)`` pairs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore_megatron.arch import ModelArch, read_hf_config
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.hf_weights import save_hf
    from rlcore_megatron.parallel import init_megatron, shutdown_megatron
    from rlcore_megatron.stacks import MegatronEvalStack, MegatronTrainingStack

__all__ = [
    "MegatronBackend",
    "MegatronEvalStack",
    "MegatronTrainingStack",
    "ModelArch",
    "init_megatron",
    "read_hf_config",
    "save_hf",
    "shutdown_megatron",
]

_WHERE = {
    "MegatronBackend": "backend",
    "MegatronEvalStack": "stacks",
    "MegatronTrainingStack": "stacks",
    "ModelArch": "arch",
    "init_megatron": "parallel",
    "read_hf_config": "arch",
    "save_hf": "hf_weights",
    "shutdown_megatron": "parallel",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rlcore_megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlcore_megatron.{_WHERE[name]}"), name)
