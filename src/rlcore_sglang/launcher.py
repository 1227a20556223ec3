"""Starting ``python -m sglang.launch_server``: one data-parallel server per
:class:`~rlcore.protocols.hosts.ProcessHost`.

A host is a place the run's placement reserved (a cluster node and its GPUs, see
``rlcore.launch.ray.cluster``) or this machine (:class:`~rlcore.engines.hosts.LocalProcessHost`).
The server listens on the host's address, uses the host's GPUs (tensor parallel over them) or its
CPU threads, and writes its log on the host. All servers start at once; if one fails, all are
stopped and the error quotes its log.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import final

import attrs

from rlcore.errors import RolloutError
from rlcore.protocols.hosts import ProcessHost
from rlcore_sglang import server_loader
from rlcore_sglang.server import SGLangServer

__all__ = ["LaunchSettings", "launch_servers", "start_server"]


def _default_weight_loader(settings: LaunchSettings) -> str | None:
    return server_loader.NAME if settings.python == sys.executable else None


@final
@attrs.frozen
class LaunchSettings:
    """How to start ``python -m sglang.launch_server`` (one process per data-parallel server).

    ``device="cpu"`` also sets ``SGLANG_USE_CPU_ENGINE=1``; on the CPU keep ``max_total_tokens``
    small (SGLang otherwise sizes its KV pool from free RAM, about 14 GB). ``python`` is the
    interpreter that has SGLang installed (default: this one; on a cluster, the same path on every
    node). ``log_dir`` receives ``sglang-<i>.log`` per server, on the server's host (default: a
    fresh temporary folder). ``SGLANG_RETURN_ORIGINAL_LOGPROB=0`` is always set (SGLang's
    default, whatever the host's environment says) so that returned log-probs are of the
    tempered distribution that sampled, as :class:`~rlcore.samples.Generation` promises. A
    server's
    ``OMP_NUM_THREADS`` is its host's CPU share unless ``env`` sets it.
    ``sleep_on_idle`` (SGLang's ``--sleep-on-idle``) lets the scheduler block on its sockets
    instead of spinning a core while no request is pending (measured on the CPU: 1.0 CPU-second
    per second idle without it, 0.02 with it). An RL run leaves its servers idle during every
    train step, often on the trainer's machine, where a spinning scheduler takes CPU from it.
    ``tp_size`` applies to hosts without GPU ids; a host with GPUs runs tensor parallel over all
    of them. ``weight_loader`` is registered as SGLang's ``--custom-weight-loader`` and named by
    tensor-mode updates: by default rlcore's (:mod:`rlcore_sglang.server_loader`, which keeps the
    shared-memory mappings between syncs) when ``python`` is this interpreter, which can import
    it, else ``None`` (SGLang's own loading). Name it only for an interpreter that can import
    it: SGLang imports a custom loader at the first update, and an import error kills the
    server then.
    """

    model_path: Path
    tokenizer_path: Path | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_total_tokens: int | None = 8192
    tp_size: int = 1
    random_seed: int = 1234
    mem_fraction_static: float | None = None
    python: str = sys.executable
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = attrs.field(factory=dict)
    startup_timeout_s: float = 600.0
    log_dir: Path | None = None
    sleep_on_idle: bool = True
    weight_loader: str | None = attrs.field(
        default=attrs.Factory(_default_weight_loader, takes_self=True)
    )

    def command(
        self, host: str, port: int, *, base_gpu_id: int = 0, tp_size: int | None = None
    ) -> list[str]:
        """The argv that starts one server on ``host:port`` (GPU servers start at
        ``base_gpu_id``)."""
        cmd = [
            self.python, "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--host", host,
            "--port", str(port),
            "--device", self.device,
            "--dtype", self.dtype,
            "--tp-size", str(tp_size or self.tp_size),
            "--random-seed", str(self.random_seed),
            # The warmup request sends text through the tokenizer; rlcore only sends token ids.
            "--skip-server-warmup",
        ]  # fmt: skip
        if self.tokenizer_path is not None:
            cmd += ["--tokenizer-path", str(self.tokenizer_path)]
        if self.max_total_tokens is not None:
            cmd += ["--max-total-tokens", str(self.max_total_tokens)]
        if self.mem_fraction_static is not None:
            cmd += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.device != "cpu":
            cmd += ["--base-gpu-id", str(base_gpu_id)]
        if self.sleep_on_idle:
            cmd.append("--sleep-on-idle")
        if self.weight_loader is not None:
            cmd += ["--custom-weight-loader", self.weight_loader]
        return cmd + list(self.extra_args)

    def environment(self, cpus: int | None = None) -> dict[str, str]:
        """What a server's process gets on top of its host's environment."""
        env = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}
        if self.model_path.is_dir():  # a local folder: never a model hub lookup
            env["HF_HUB_OFFLINE"] = "1"
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        if cpus is not None:
            env["OMP_NUM_THREADS"] = str(cpus)
        env.update(self.env)
        return env


def launch_servers(settings: LaunchSettings, hosts: Sequence[ProcessHost]) -> list[SGLangServer]:
    """Start one server per host at once and wait until every one is healthy; if any fails, stop
    them all and raise :class:`~rlcore.errors.RolloutError` with its log tail."""
    servers: list[SGLangServer] = []
    try:
        for index, host in enumerate(hosts):
            servers.append(start_server(settings, host, index))
        for server in servers:
            server.wait_until_healthy(settings.startup_timeout_s)
    except BaseException:
        for server in servers:
            server.shutdown()
        raise
    return servers


def start_server(
    settings: LaunchSettings, host: ProcessHost, index: int = 0, restart: int = 0
) -> SGLangServer:
    """Start server ``index`` on ``host`` (log ``sglang-<index>.log``; its ``restart``-th restart
    logs to ``sglang-<index>.restart<restart>.log``, keeping the failed one's log) without
    waiting for it; call its ``wait_until_healthy`` next."""
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="rlcore-sglang-"))
    log = log_dir / (f"sglang-{index}.restart{restart}.log" if restart else f"sglang-{index}.log")
    gpus = host.gpu_ids
    if gpus and gpus != tuple(range(gpus[0], gpus[0] + len(gpus))):
        raise RolloutError(
            f"SGLang server {index}: its GPUs {list(gpus)} on {host.address} are not consecutive "
            "CUDA ordinals, which SGLang's --base-gpu-id needs; make "
            "--rollout-num-gpus-per-engine divide the GPUs of a node"
        )
    port = host.free_port()
    cmd = settings.command(
        host.address,
        port,
        base_gpu_id=gpus[0] if gpus else 0,
        tp_size=len(gpus) if gpus else settings.tp_size,
    )
    try:
        process = host.start(cmd, settings.environment(host.cpus), log)
    except RolloutError as exc:
        raise RolloutError(
            f"could not start SGLang server {index} on {host.address}: {exc}; pass "
            "LaunchSettings(python=...) pointing at an interpreter with sglang installed"
        ) from exc
    return SGLangServer(
        f"http://{_url_host(host.address)}:{port}", process=process, log_path=str(log)
    )


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
