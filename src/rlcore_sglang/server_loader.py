"""Runs inside an SGLang server: the weight loader that tensor-mode updates name.

Launched servers register it (``--custom-weight-loader rlcore_sglang.server_loader.load_weights``,
:attr:`~rlcore_sglang.launcher.LaunchSettings.weight_loader`); a connected server that lists it in
``/server_info`` is used the same way. It loads the weights as SGLang does, then keeps each CPU
tensor it received, by name, until the next tensor of that name arrives.

Why: a CPU tensor that arrives over ``/update_weights_from_tensor`` is a mapping of the sender's
shared memory (torch's ``file_system`` strategy), and torch reuses a mapping that is still alive
when the same segment arrives again. The senders send the same segments sync after sync (a
Megatron rank's parameters and export buffers, the tensor sink's two buffers), so from the second
sync on the server maps nothing and faults in no pages: it only copies. Without it, every sync
maps the model's bytes anew (measured with ``benchmarks/weight_sync.py``: the server's load of a
512 MB bucket took 0.10-0.40 s, against 0.03-0.05 s with its mappings kept).

What it keeps costs no memory of its own while the sender lives (the pages are the sender's).
A segment the sender has dropped stays until a newer tensor of that name arrives or the server
exits. CUDA tensors are not kept: an IPC handle held open pins the sender's GPU memory, and
there are no page faults to save.

Imports nothing at run time (the launcher reads :data:`NAME` without pulling in torch); the
server's interpreter must be able to import ``rlcore_sglang``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["NAME", "load_weights"]

NAME = f"{__name__}.load_weights"
"""What ``--custom-weight-loader`` and the ``load_format`` of an update say."""


class _Model(Protocol):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


_KEPT: dict[str, torch.Tensor] = {}
"""The latest CPU tensor received under each name, in this server process."""


def load_weights(model: _Model, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's ``model.load_weights(named_tensors)``, then keep the CPU tensors' mappings."""
    received = list(named_tensors)
    model.load_weights(received)
    for name, tensor in received:
        if tensor.device.type == "cpu":
            _KEPT[name] = tensor
