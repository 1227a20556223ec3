"""What a launch starts, each a function: Ray (joined, or a local instance of this machine), the
metrics sinks the config asks for, and the rollout engine the config names (built by its kind,
in the trainer's dtype, wrapped for multi-turn episodes), each logged with the time it took."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from rlcore.config import RunConfig
from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.engines import EngineSetup, load_engine
from rlcore.launch.console import ProgressSink, WandbSink
from rlcore.launch.prepare import local_node
from rlcore.loop.metrics import JsonlSink, MultiSink, StepsFrom, TensorBoardSink
from rlcore.loop.plan import Plan, RolloutOnlyPlan, TrainPlan
from rlcore.protocols.engine import RolloutEngine
from rlcore.protocols.hosts import ProcessHost
from rlcore.protocols.metrics import MetricsSink
from rlcore.rollout.multiturn import (
    EpisodeEngine,
    load_custom_generate_function,
    load_environment_factory,
)
from rlcore.specs import Precision

__all__ = [
    "engine_dtype",
    "episodes",
    "make_engine",
    "set_engine_threads",
    "start_ray",
    "start_sinks",
    "timed_engine",
]

log = logging.getLogger("rlcore")


def engine_dtype(config: RunConfig) -> Precision:
    """The rollout engine's dtype: the trainer's (``bfloat16`` with ``--bf16``, else ``float32``),
    so that the weights synced after every step arrive unconverted and the engine's log-probs are
    comparable with the trainer's."""
    return "bfloat16" if config.model.bf16 else "float32"


def make_engine(
    config: RunConfig, tokenizer: HFTokenizer, hosts: Sequence[ProcessHost] = ()
) -> RolloutEngine:
    """The rollout engine the config names (``--rollout-engine``), built by its kind from the
    initial HF weights in :func:`engine_dtype`; its servers, if any, on ``hosts``."""
    assert config.model.hf_checkpoint is not None
    kind = load_engine(config.rollout.engine)
    setup = EngineSetup(
        model_path=config.model.hf_checkpoint,
        tokenizer=tokenizer,
        seed=config.seed,
        log_dir=config.output_dir / kind.name,
        hosts=tuple(hosts),
        dtype=engine_dtype(config),
        fault_tolerance=config.rollout.use_fault_tolerance,
    )
    return kind.build(setup, config.rollout.engine_options)


def episodes(
    config: RunConfig, engine: RolloutEngine | None, tokenizer: HFTokenizer
) -> RolloutEngine | None:
    """``engine`` wrapped so that every sample is a multi-turn episode (an
    :class:`~rlcore.rollout.multiturn.EpisodeEngine`) when the config gives an environment or a
    custom generate function; else ``engine`` itself."""
    mt = config.multiturn
    if engine is None or not mt.enabled:
        return engine
    return EpisodeEngine(
        engine,
        tokenizer,
        max_turns=mt.max_turns,
        make_environment=(
            load_environment_factory(mt.environment_path) if mt.environment_path else None
        ),
        generate_fn=(
            load_custom_generate_function(mt.custom_generate_function_path)
            if mt.custom_generate_function_path
            else None
        ),
    )


def start_sinks(config: RunConfig, the_plan: Plan, resumed_at: int | None = None) -> MetricsSink:
    """Every sink the config asks for; when one fails to start, those already started are closed
    (the progress display included) before the error propagates. A resumed run
    (``resumed_at``: the first step it logs anew, :func:`_rewind`) rewinds TensorBoard
    (``purge_step``) and W&B (``resume_from``) to that step and sends them no earlier one: they
    keep what the earlier attempt logged before it, the evaluation of the loaded checkpoint
    included."""
    out = config.output_dir
    sinks: list[MetricsSink] = []

    def resumed(sink: MetricsSink) -> MetricsSink:
        return sink if resumed_at is None else StepsFrom(sink, resumed_at)

    try:
        sinks.append(JsonlSink(out / "metrics.jsonl"))
        if isinstance(the_plan, TrainPlan | RolloutOnlyPlan):
            sinks.append(ProgressSink(total=the_plan.num_rollout))
        if config.use_tensorboard:
            sinks.append(resumed(TensorBoardSink(out / "tensorboard", purge_step=resumed_at)))
        if config.use_wandb:
            sinks.append(resumed(WandbSink(out, config, rewind_to=resumed_at)))
    except BaseException:
        MultiSink(sinks).close()
        raise
    return MultiSink(sinks)


def _not_the_token_notice(record: logging.LogRecord) -> bool:
    """Ray's notice that a cluster it starts has token authentication (its default, which a run
    keeps): there is nothing to do about it, so it is dropped; Ray's other warnings stay (the
    one that a cluster has none, which asks for a token, among them)."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray")


def start_ray(config: RunConfig) -> None:
    """Join ``--ray-address`` or start a local instance of this machine, logging how long it
    took."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        _not_the_token_notice
    )
    import ray

    from rlcore.launch.ray.ranks import RayGroupError

    if ray.is_initialized():
        return
    started = time.monotonic()
    if config.ray_address is not None:
        try:
            ray.init(address=config.ray_address, log_to_driver=False, logging_level=logging.WARNING)
        except ConnectionError as exc:
            # Ray's reason, on its last line.
            cause = str(exc.__cause__ or "").strip().splitlines()[-1:]
            raise RayGroupError(
                f"--ray-address {config.ray_address}: could not join the Ray cluster: {exc}"
                + "".join(f"\n{line}" for line in cause)
                + "\n"
                "Is it running (`ray status --address ...`)? A cluster with token authentication "
                "(what Ray starts by default) also needs RAY_AUTH_MODE=token here, with its token "
                "in ~/.ray/auth_token or RAY_AUTH_TOKEN: Ray sends no token to an explicit address "
                "unasked."
            ) from exc
        log.info(
            "ray: joined the cluster at %s (%.1f s)",
            ray.get_runtime_context().gcs_address,
            time.monotonic() - started,
        )
    else:
        local = local_node()
        ray.init(
            # Its own instance even when another one runs on this machine: without "local", Ray
            # joins the last cluster `ray start` began here and then refuses num_cpus.
            address="local",
            num_cpus=int(local.cpus),
            num_gpus=int(local.gpus),
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,  # "Started a local Ray instance": logged below
        )
        log.info(
            "ray: started a local instance at %s (%.1f s)",
            ray.get_runtime_context().gcs_address,
            time.monotonic() - started,
        )


def timed_engine(
    config: RunConfig, tokenizer: HFTokenizer, hosts: Sequence[ProcessHost]
) -> RolloutEngine:
    """:func:`make_engine`, logging how long it took (loading the model, starting servers)."""
    started = time.monotonic()
    engine = make_engine(config, tokenizer, hosts)
    log.info(
        "rollout engine: %s, ready (%.1f s)", config.rollout.engine, time.monotonic() - started
    )
    return engine


def set_engine_threads(threads: int) -> None:
    """torch threads of this process: its rollout engine's share of the machine, so that it
    generates beside the ranks instead of competing with them for every core."""
    import torch

    torch.set_num_threads(threads)
    log.info("rollout engine in this process: %d torch thread(s)", threads)
