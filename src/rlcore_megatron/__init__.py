"""The Megatron backend for rlcore: Megatron-core stacks, HF <-> Megatron weights, the CPU shim.

``import rlcore_megatron`` is light (a Ray driver imports it without megatron); the names below
import their module on first use. It ignores the start-up warnings of Megatron that no user can
act on (:data:`QUIET`), in every process that imports it (the ranks too) before Megatron.

- :class:`MegatronBackend` (``rlcore.backend_api.Backend``) builds
  :class:`MegatronTrainingStack` and :class:`MegatronEvalStack` on this rank.
- :func:`init_megatron` initialises ``torch.distributed`` and Megatron's parallel state,
  idempotently.
- :func:`save_hf` writes an HF checkpoint from a stack or from ``(hf_name, tensor)`` pairs.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from rlcore_megatron.backend import MegatronBackend
    from rlcore_megatron.model.arch import ModelArch, read_hf_config
    from rlcore_megatron.model.hf_weights import save_hf
    from rlcore_megatron.parallel import init_megatron, shutdown_megatron
    from rlcore_megatron.stacks import MegatronEvalStack, MegatronTrainingStack

__all__ = [
    "MegatronBackend",
    "MegatronEvalStack",
    "MegatronTrainingStack",
    "ModelArch",
    "QUIET",
    "init_megatron",
    "read_hf_config",
    "save_hf",
    "shutdown_megatron",
]

_WHERE = {
    "MegatronBackend": "backend",
    "MegatronEvalStack": "stacks",
    "MegatronTrainingStack": "stacks",
    "ModelArch": "model.arch",
    "init_megatron": "parallel",
    "read_hf_config": "model.arch",
    "save_hf": "model.hf_weights",
    "shutdown_megatron": "parallel",
}


QUIET: Final = (
    # Megatron without Transformer Engine or Apex (always on the CPU, and by design: the backend
    # builds Megatron's local layers) says so once per module it imports.
    ("Transformer Engine and Apex are not installed", UserWarning, r"megatron\."),
    ("Apex is not installed", UserWarning, r"megatron\."),
    # Megatron's own default for TransformerConfig.cuda_graph_scope ("full") warns in its own
    # __post_init__; the backend uses no CUDA graphs.
    ("full scope is deprecated", UserWarning, r"megatron\.core\.transformer"),
    # What Megatron's dist_checkpointing calls in torch, on every save and load.
    ("`load_state_dict` is deprecated", FutureWarning, r"megatron\.core\.dist_checkpointing"),
    ("Please use DTensor instead", FutureWarning, r"torch\.distributed\.checkpoint"),
)
"""``(message, category, module)`` of the warnings Megatron gives on every run that no user can
act on; importing this package ignores them (each scoped to its message and the module that
warns, so any other warning still shows)."""

for _message, _category, _module in QUIET:
    warnings.filterwarnings("ignore", message=_message, category=_category, module=_module)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rlcore_megatron' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlcore_megatron.{_WHERE[name]}"), name)
