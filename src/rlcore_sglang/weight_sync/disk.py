"""Disk-mode weight sync (``--weight-sync disk``): safetensors shards in a shared folder.

:class:`DiskSink` writes the weights as safetensors shards, one per bucket, and their index into
``root / weights-v<version>``, then asks every server to ``/update_weights_from_disk`` from it
and removes the folders of older versions. It runs anywhere that shares the folder with the
servers (:class:`~rlcore.weights.AnyProcess`).
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import final

import attrs

from rlcore.weights import AnyProcess, NamedTensors
from rlcore_sglang.options import EngineOptions
from rlcore_sglang.server import run_all
from rlcore_sglang.weight_sync.base import ServerRef, iter_buckets, post_ok_to

__all__ = ["DiskSink"]


@final
@attrs.frozen
class DiskSink:
    """safetensors shards in ``root / weights-v<version>``, loaded by every server."""

    servers: tuple[ServerRef, ...]
    root: Path
    version: int
    options: EngineOptions

    @property
    def placement(self) -> AnyProcess:
        return AnyProcess()

    def receive(self, weights: NamedTensors) -> None:
        folder = self.root / f"weights-v{self.version}"
        _write_shards(weights, folder, self.options.bucket_bytes)
        payload: dict[str, object] = {
            "model_path": str(folder),
            "weight_version": str(self.version),
            "flush_cache": True,
        }
        path = "/update_weights_from_disk"
        run_all(
            [partial(post_ok_to, self.options, s, path, payload) for s in self.servers],
            len(self.servers),
        )
        for old in self.root.glob("weights-v*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)


def _write_shards(weights: NamedTensors, folder: Path, max_bytes: int) -> None:
    """One ``bucket-NNNNN.safetensors`` per bucket and ``model.safetensors.index.json`` naming
    them (what Hugging Face loaders, SGLang's included, read), written last."""
    from safetensors.torch import save_file

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    for index, (bucket, _) in enumerate(iter_buckets(weights, max_bytes)):
        filename = f"bucket-{index:05d}.safetensors"
        tensors = {name: t.to("cpu").contiguous() for name, t in bucket}
        save_file(tensors, str(folder / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1))
