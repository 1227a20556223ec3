"""SGLang as rlcore's rollout engine (``--rollout-engine sglang``): data-parallel servers launched
on the run's rollout GPUs (or this machine) or connected by URL, and weights sent to them straight
from the training ranks.

``import rlcore_sglang`` is light (the names below import their module on first use), and no
module here imports ``sglang``: the servers are separate processes, spoken to over HTTP.

- :class:`SGLangEngine` (:mod:`rlcore_sglang.client`): the ``rlcore.RolloutEngine``.
- :class:`LaunchSettings` (:mod:`rlcore_sglang.launcher`): how a server is started.
- :class:`SGLangServer` (:mod:`rlcore_sglang.server`): one HTTP endpoint and its process.
- :class:`SGLangTeacher` (:mod:`rlcore_sglang.teacher`): a distillation teacher served by SGLang
  (``--opd-type sglang``).
- The weight sinks (:mod:`rlcore_sglang.weight_sync`): tensor, distributed, disk.
- ``/generate``'s requests and answers (:mod:`rlcore_sglang.generate`).
- :class:`SGLangOptions` / :class:`EngineOptions` (:mod:`rlcore_sglang.options`): the run's flags
  and the client's settings.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcore_sglang.client import SGLangEngine
    from rlcore_sglang.launcher import LaunchSettings
    from rlcore_sglang.options import EngineOptions, SGLangOptions, WeightSyncMode
    from rlcore_sglang.server import SGLangServer
    from rlcore_sglang.teacher import SGLangTeacher

__all__ = [
    "EngineOptions",
    "LaunchSettings",
    "SGLangEngine",
    "SGLangOptions",
    "SGLangServer",
    "SGLangTeacher",
    "WeightSyncMode",
]

_WHERE = {
    "EngineOptions": "options",
    "LaunchSettings": "launcher",
    "SGLangEngine": "client",
    "SGLangOptions": "options",
    "SGLangServer": "server",
    "SGLangTeacher": "teacher",
    "WeightSyncMode": "options",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rlcore_sglang' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlcore_sglang.{_WHERE[name]}"), name)
