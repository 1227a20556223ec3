"""``--rollout-engine sglang`` as the run finds it (:data:`SGLANG`, registered in
:data:`rlcore.engines.KNOWN_ENGINES`). Light: the engine itself is imported when it is built."""

from __future__ import annotations

from pathlib import Path
from typing import Final

from rlcore.engines import EngineKind, EngineSetup
from rlcore.errors import ConfigError, ConfigProblem, RolloutError
from rlcore.protocols.engine import RolloutEngine, TeacherServer
from rlcore_sglang.options import SGLangOptions

__all__ = ["SGLANG", "build"]


def build(setup: EngineSetup, options: SGLangOptions) -> RolloutEngine:
    """Connect to ``options.urls``, or launch one server on each of ``setup.hosts`` (GPU hosts:
    on CUDA, tensor parallel over the host's GPUs), in the trainer's dtype (``setup.dtype``: fp32,
    or bf16 with ``--bf16``, on GPU and CPU hosts alike)."""
    from rlcore_sglang.client import SGLangEngine
    from rlcore_sglang.launcher import LaunchSettings
    from rlcore_sglang.options import EngineOptions, FaultTolerance

    if setup.fault_tolerance and options.weight_sync == "distributed":
        raise ConfigError(
            [
                ConfigProblem(
                    "sglang.weight_sync (--weight-sync)",
                    "distributed cannot be combined with --use-fault-tolerance: a restarted "
                    "server is not in the process group the weights are broadcast over",
                    "use --weight-sync tensor (servers on the ranks' machines) or disk",
                )
            ]
        )
    sync_dir = options.weight_sync_dir or setup.log_dir / "weights"
    engine_options = EngineOptions(
        weight_sync=options.weight_sync,
        bucket_bytes=options.update_weight_buffer_size,
        sync_dir=sync_dir if options.weight_sync == "disk" else None,
        fault_tolerance=(
            FaultTolerance(
                max_restarts=options.max_engine_restarts,
                health_check_interval_s=options.health_check_interval,
                health_check_timeout_s=options.health_check_timeout,
            )
            if setup.fault_tolerance
            else None
        ),
    )
    if options.urls:
        return SGLangEngine.connect(options.urls, engine_options)
    hosts = setup.hosts
    if not hosts:
        from rlcore.engines.hosts import LocalProcessHost

        hosts = (LocalProcessHost(),)
    on_gpu = any(host.gpu_ids for host in hosts)
    settings = LaunchSettings(
        model_path=setup.model_path,
        device="cuda" if on_gpu else "cpu",
        dtype=setup.dtype,
        random_seed=setup.seed,
        mem_fraction_static=options.mem_fraction_static,
        log_dir=setup.log_dir,
    )
    return SGLangEngine.launch(settings, options=engine_options, hosts=hosts)


def connect_teacher(url: str, timeout_s: float) -> tuple[TeacherServer, Path | None]:
    """The distillation teacher an SGLang server at ``url`` serves (``--opd-type sglang``), once
    it answers ``/health`` (within ``timeout_s``), and the folder it serves when readable here."""
    from rlcore_sglang.options import EngineOptions
    from rlcore_sglang.teacher import SGLangTeacher

    try:
        teacher = SGLangTeacher.connect(url, EngineOptions(health_timeout_s=timeout_s))
    except RolloutError as exc:
        raise RolloutError(
            f"{str(exc).splitlines()[0]} (start it first: python -m sglang.launch_server "
            "--model-path TEACHER ...)"
        ) from exc
    return teacher, teacher.model_folder()


SGLANG: Final[EngineKind[SGLangOptions]] = EngineKind(
    "sglang",
    SGLangOptions,
    build,
    lambda options: not options.urls,
    "rlcore[sglang]",
    connect_teacher=connect_teacher,
)
"""SGLang servers: launched on the run's rollout hosts, or connected by ``--sglang-url``."""
