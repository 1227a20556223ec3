"""SGLang's settings: what a run sets (:class:`SGLangOptions`, flags and the ``[sglang]`` section of
a config file) and how the client talks to its servers (:class:`EngineOptions`).

Light on purpose (attrs only): ``python -m rlcore_megatron.run --help`` lists these flags without
importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Final, Literal, final

import attrs

from rlcore.config import option
from rlcore.errors import ConfigError, ConfigProblem

__all__ = [
    "WEIGHT_SYNC_MODES",
    "EngineOptions",
    "FaultTolerance",
    "SGLangOptions",
    "WeightSyncMode",
]

WeightSyncMode = Literal["tensor", "distributed", "disk"]
WEIGHT_SYNC_MODES: Final[tuple[WeightSyncMode, ...]] = ("tensor", "distributed", "disk")
DEFAULT_BUCKET_BYTES: Final = 512 * 1024**2


@final
@attrs.frozen
class SGLangOptions:
    """``--rollout-engine sglang``: the flags below, or the ``[sglang]`` section of ``--config``.

    Where the servers run is the run's placement (``--rollout-num-gpus``,
    ``--rollout-num-gpus-per-engine``, ``--colocate``), not an SGLang setting.
    """

    urls: tuple[str, ...] = option(
        (),
        "--sglang-url",
        "connect to a running SGLang server (repeatable); none: launch servers on the rollout GPUs",
        repeat=True,
    )
    weight_sync: WeightSyncMode = option(
        "tensor",
        "--weight-sync",
        "how weights reach the servers: tensor (shared memory, from a rank on the server's "
        "machine), distributed (a process group with the servers) or disk",
    )
    update_weight_buffer_size: int = option(
        DEFAULT_BUCKET_BYTES, "--update-weight-buffer-size", "bytes per weight-sync bucket"
    )
    weight_sync_dir: Path | None = option(
        None,
        "--weight-sync-dir",
        "disk mode: a folder the ranks and the servers share (default: OUTPUT_DIR/sglang/weights)",
    )
    mem_fraction_static: float | None = option(
        None,
        "--sglang-mem-fraction-static",
        "launched servers: GPU memory fraction for weights and KV cache (SGLang's own default "
        "when unset; lower it with --colocate)",
    )

    max_engine_restarts: int = option(
        3,
        "--max-engine-restarts",
        "with --use-fault-tolerance: restarts of each launched server over the run; one failure "
        "more ends it",
    )
    health_check_interval: float = option(
        10.0,
        "--rollout-health-check-interval",
        "with --use-fault-tolerance: seconds between two /health calls to each server",
    )
    health_check_timeout: float = option(
        30.0,
        "--rollout-health-check-timeout",
        "with --use-fault-tolerance: a server that answers no /health within this many seconds, "
        "twice in a row, is stopped and restarted",
    )

    def __attrs_post_init__(self) -> None:
        problems = []

        def add(name: str, message: str, hint: str = "") -> None:
            flag = attrs.fields_dict(SGLangOptions)[name].metadata["flag"]
            problems.append(ConfigProblem(f"sglang.{name} ({flag})", message, hint))

        if self.update_weight_buffer_size < 1:
            add("update_weight_buffer_size", f"must be >= 1, got {self.update_weight_buffer_size}")
        fraction = self.mem_fraction_static
        if fraction is not None and not 0 < fraction <= 1:
            add("mem_fraction_static", f"must be in (0, 1], got {fraction}")
        if self.max_engine_restarts < 0:
            add("max_engine_restarts", f"must be >= 0, got {self.max_engine_restarts}")
        for name in ("health_check_interval", "health_check_timeout"):
            if getattr(self, name) <= 0:
                add(name, f"must be > 0, got {getattr(self, name)}")
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            add("urls", f"not HTTP URLs: {bad}", "write http://HOST:PORT")
        if problems:
            raise ConfigError(problems)


@final
@attrs.frozen
class FaultTolerance:
    """``--use-fault-tolerance``: how the servers an engine launched are restarted when one dies
    or stops answering (the engine then resubmits the requests it held)."""

    max_restarts: int = 3
    """Restarts of each server over the engine's life; its next failure is an error."""
    backoff_s: float = 1.0
    """A server's ``n``-th restart waits ``backoff_s * 2 ** (n - 1)`` seconds first."""
    health_check_interval_s: float = 10.0
    """Seconds between two ``/health`` calls to each server (a monitor thread)."""
    health_check_timeout_s: float = 30.0
    """A server that answers no ``/health`` within this, twice in a row, is stopped; the next
    request or weight update that needs it restarts it."""


@final
@attrs.frozen
class EngineOptions:
    """How the client talks to its servers. Every wait is bounded by one of the timeouts."""

    weight_sync: WeightSyncMode = "tensor"
    """``tensor`` (same machine), ``distributed`` (torch.distributed broadcast) or ``disk``."""
    max_concurrent_requests: int = 16
    """``/generate`` calls in flight at once, over all servers."""
    max_prompts_per_request: int = 32
    """Prompts batched into one ``/generate`` call."""
    request_timeout_s: float = 600.0
    """Limit for one ``/generate`` call."""
    connect_retries: int = 3
    """Retries of a call that failed at the connection level, with exponential backoff."""
    retry_backoff_s: float = 0.5
    weight_sync_timeout_s: float = 600.0
    """Limit for each weight-sync step: an HTTP call, the group join, one bucket's broadcast."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Weights are sent in buckets of at most this many bytes (a larger tensor goes alone);
    ``--update-weight-buffer-size``."""
    sync_dir: Path | None = None
    """Where the ``disk`` mode writes safetensors (default: a temporary folder). On a cluster, a
    folder the sending rank and every server can read."""
    master_address: str | None = None
    """``distributed`` mode: the address of the sending process, as the servers reach it
    (default: the sender's address on the route to the first server)."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto`` is NCCL when the sender has CUDA, else gloo."""
    extra_sampling_params: Mapping[str, object] = attrs.field(factory=dict)
    """Passed to SGLang as is (``repetition_penalty`` ...); unknown names are rejected by SGLang."""
    health_timeout_s: float = 60.0
    """Limit for a connected server's first ``/health`` answer."""
    fault_tolerance: FaultTolerance | None = None
    """Restart launched servers that fail and resubmit their requests (``None``: a dead server is
    an error, reported with its log)."""

    def __attrs_post_init__(self) -> None:
        if self.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(
                f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {self.weight_sync!r}"
            )
        if self.max_concurrent_requests < 1 or self.max_prompts_per_request < 1:
            raise ValueError("max_concurrent_requests and max_prompts_per_request must be >= 1")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {self.bucket_bytes}")
        if self.fault_tolerance is not None and self.weight_sync == "distributed":
            raise ValueError(
                "fault tolerance restarts servers with the tensor and disk weight syncs only: a "
                "restarted server is not in the distributed mode's process group"
            )
