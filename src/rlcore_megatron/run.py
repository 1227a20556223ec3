"""``python -m rlcore_megatron.run``: flags or ``--config`` -> RunConfig -> plan -> Ray -> Megatron
stacks in train groups -> rollout engine -> the core loop.

With no flags at all it runs the self-contained CPU demo (:mod:`rlcore_megatron.demo`).

Fail fast, leave nothing behind. Before Ray or any model starts, :func:`preflight` checks the
model folder (its files, every safetensors file complete, ``config.json`` read by the Megatron
backend's own validator), that ``--load`` names a checkpoint and that the output folders can be
written; then the data is read and checked (a malformed file stops the run with the file and
line), and a ``--load`` that leaves nothing to train is refused. A run that stops there removes
the folders it created. Nothing is downloaded: model folders are local (``HF_HUB_OFFLINE``).
A watchdog kills what the run started if the driver is killed; Ctrl-C stops cleanly, writes
``summary.json`` (interrupted at which rollout, the latest checkpoint) and exits with 130.

Metrics go to ``OUTPUT_DIR/metrics.jsonl`` (and TensorBoard / wandb when asked); the log to
``OUTPUT_DIR/run.log`` and the console.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from rlcore.checkpoint_files import find_checkpoint
from rlcore.config import RunConfig, with_flag
from rlcore.config.flags import build_parser, load_config
from rlcore.data import HFTokenizer, load_eval_sets, load_prompts
from rlcore.engines import EngineSetup, load_engine
from rlcore.errors import CheckpointError, ConfigError, ConfigProblem, PlanError, RLCoreError
from rlcore.loop import RunData, RunInterrupted, RunResult, check_inputs, resume_point, run
from rlcore.loop.metrics import JsonlSink, MultiSink, TensorBoardSink
from rlcore.loop.plan import Plan, RolloutOnlyPlan, TrainPlan, plan, resolve_num_rollout
from rlcore.loop.preflight import (
    check_model_folder,
    prepare_output_folders,
    remove_earlier_checkpoints,
    remove_folders,
    save_folder_problems,
)
from rlcore.loop.records import Progress
from rlcore.protocols import MetricsSink, ProcessHost, RolloutEngine
from rlcore.rollout import load_group_filter, load_rollout_function
from rlcore.rollout.multiturn import (
    EpisodeEngine,
    load_custom_generate_function,
    load_environment_factory,
    with_env_reward,
)
from rlcore.rollout.rewards import get_reward_fn
from rlcore.samples import Prompt
from rlcore.specs import Precision
from rlcore_megatron.console import ProgressSink, WandbSink, log_to_file, setup_logging
from rlcore_megatron.placement import NodeResources, PlacementRequest, plan_layout
from rlcore_megatron.run_record import interrupted_message, start_output_folder, write_summary
from rlcore_megatron.watchdog import watch_tree

__all__ = [
    "engine_dtype",
    "execute",
    "load_run_data",
    "main",
    "make_engine",
    "placement_request",
    "preflight",
]

log = logging.getLogger("rlcore")

DEMO_FOLDER = Path("runs/demo")
DESCRIPTION = (
    "RL post-training with a Megatron backend, Ray and a rollout engine. With no flags, runs a "
    "small self-contained demo on the CPU. Flags keep slime's names; --config reads a TOML file "
    "(sections as below) and flags override it. --num-rollout 0 evaluates only."
)


def _model_problems(hf_config: dict[str, Any], path: Path, where: str) -> list[ConfigProblem]:
    """What the Megatron backend cannot build in ``config.json``, by its own validator (which
    imports no Megatron)."""
    from rlcore_megatron.arch import arch_from_hf_config

    try:
        arch_from_hf_config(hf_config, str(path))
    except ConfigError as exc:
        return [
            ConfigProblem(where, f"{path}: {p.path}: {p.message}", p.hint) for p in exc.problems
        ]
    return []


def preflight(config: RunConfig) -> list[Path]:
    """Check, before anything starts, what the run needs from the file system: the model folder
    (files present, safetensors complete, ``config.json`` buildable), the checkpoint ``--load``
    names, and that ``--output-dir`` and ``--save`` can be created and written.

    Returns the folders it created. Raises one :class:`ConfigError` listing every problem, after
    removing them.
    """
    problems: list[ConfigProblem] = []
    where = with_flag("model.hf_checkpoint")
    folder = config.model.hf_checkpoint
    if folder is None:
        problems.append(
            ConfigProblem(
                where, "no model given", "point --hf-checkpoint at a Hugging Face model folder"
            )
        )
    else:
        found, hf_config = check_model_folder(folder, where)
        problems += found
        if hf_config:
            problems += _model_problems(hf_config, folder / "config.json", where)
    if config.checkpoint.load is not None:
        try:
            find_checkpoint(config.checkpoint.load)
        except CheckpointError as exc:
            problems.append(ConfigProblem(with_flag("checkpoint.load"), str(exc)))
    outputs = [(with_flag("output_dir"), config.output_dir)]
    c = config.checkpoint
    if c.save is not None:
        outputs.append((with_flag("checkpoint.save"), c.save))
        fresh = c.load is None or c.finetune
        problems += save_folder_problems(c.save, c.load, fresh=fresh, overwrite=c.overwrite_save)
    created: list[Path] = []
    try:
        created = prepare_output_folders(outputs)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        remove_folders(created)
        raise ConfigError(problems)
    return created


def _tokenizer(config: RunConfig) -> HFTokenizer:
    from transformers import AutoTokenizer

    folder = config.model.hf_checkpoint
    if folder is None:
        raise ConfigError(
            [
                ConfigProblem(
                    "model.hf_checkpoint (--hf-checkpoint)",
                    "no model given",
                    "point --hf-checkpoint at a Hugging Face model folder",
                )
            ]
        )
    try:
        # A local folder only: never a model hub lookup (which waits on the network).
        return HFTokenizer(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
    except OSError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "model.hf_checkpoint (--hf-checkpoint)",
                    f"no tokenizer in {folder}: {exc}",
                    "save the tokenizer beside the model",
                )
            ]
        ) from exc


def load_run_data(config: RunConfig, tokenizer: HFTokenizer) -> RunData:
    """Every prompt the run needs, read and validated before anything heavy is built."""
    d = config.data
    train: tuple[Prompt, ...] = ()
    if not config.is_eval_only:
        if d.prompt_data is None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "data.prompt_data (--prompt-data)",
                        "a training run needs prompts",
                        "add --prompt-data FILE.jsonl, or --num-rollout 0 to evaluate only",
                    )
                ]
            )
        train = load_prompts(
            d.prompt_data,
            tokenizer=tokenizer,
            input_key=d.input_key,
            label_key=d.label_key,
            apply_chat_template=d.apply_chat_template,
        )
    eval_sets = load_eval_sets(
        [(e.name, e.path) for e in config.eval.prompt_data],
        tokenizer=tokenizer,
        input_key=d.input_key,
        label_key=d.label_key,
        apply_chat_template=d.apply_chat_template,
    )
    return RunData(train_prompts=train, eval_sets=eval_sets, seed=config.seed)


def engine_dtype(config: RunConfig) -> Precision:
    """The rollout engine's dtype: the trainer's (``bfloat16`` with ``--bf16``, else ``float32``),
    so that the weights synced after every step arrive unconverted and the engine's log-probs are
    comparable with the trainer's."""
    return "bfloat16" if config.model.bf16 else "float32"


def placement_request(config: RunConfig, the_plan: Plan) -> PlacementRequest:
    """What the run needs placed: the planned stacks' ranks (an eval-only run: the actor's only)
    and, when the engine runs servers, the rollout GPUs."""
    k = config.cluster
    kind = load_engine(config.rollout.engine)
    servers = kind.runs_servers(kind.options(config.rollout.engine_options))
    critic = isinstance(the_plan, TrainPlan) and the_plan.critic is not None
    reference = isinstance(the_plan, TrainPlan) and the_plan.reference is not None
    overlaps = isinstance(the_plan, TrainPlan) and the_plan.max_staleness > 0
    return PlacementRequest(
        actor_ranks=k.actor_ranks,
        critic_ranks=k.critic_ranks if critic else 0,
        reference=reference,
        rollout_gpus=k.rollout_gpus if servers else 0,
        gpus_per_engine=k.rollout_num_gpus_per_engine,
        colocate=k.colocate,
        # An engine in this process that generates while the ranks train gets a CPU slot of its
        # own, on the local CPU instance (a joined cluster does not place this process).
        driver_engine=(
            overlaps and not servers and config.ray_address is None and local_node().gpus == 0
        ),
    )


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


def check_user_functions(config: RunConfig) -> None:
    """Import every function a ``--...-path`` flag names, so that a bad path stops the run before
    Ray, the engine or any model starts (a :class:`ConfigError` naming the flag)."""
    r, a = config.rollout, config.algorithm
    if r.rollout_function_path is not None:
        load_rollout_function(r.rollout_function_path)
    if r.dynamic_sampling_filter_path is not None:
        load_group_filter(r.dynamic_sampling_filter_path)
    if config.multiturn.environment_path is not None:
        load_environment_factory(config.multiturn.environment_path)
    if config.multiturn.custom_generate_function_path is not None:
        load_custom_generate_function(config.multiturn.custom_generate_function_path)
    if config.corrects_off_policy and a.custom_tis_function_path is not None:
        from rlcore.algorithms.correction import load_is_weight_fn

        load_is_weight_fn(a.custom_tis_function_path)


def _sinks(config: RunConfig, the_plan: Plan) -> MetricsSink:
    """Every sink the config asks for; when one fails to start, those already started are closed
    (the progress display included) before the error propagates."""
    out = config.output_dir
    sinks: list[MetricsSink] = []
    try:
        sinks.append(JsonlSink(out / "metrics.jsonl"))
        if isinstance(the_plan, TrainPlan | RolloutOnlyPlan):
            sinks.append(ProgressSink(total=the_plan.num_rollout))
        if config.use_tensorboard:
            sinks.append(TensorBoardSink(out / "tensorboard"))
        if config.use_wandb:
            sinks.append(WandbSink(out, config))
    except BaseException:
        MultiSink(sinks).close()
        raise
    return MultiSink(sinks)


def _start_ray(config: RunConfig) -> None:
    import ray

    from rlcore_megatron.ray_group import RayGroupError

    if ray.is_initialized():
        return
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
        log.info("ray: joined the cluster at %s", ray.get_runtime_context().gcs_address)
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
        log.info("ray: started a local instance at %s", ray.get_runtime_context().gcs_address)


def _ray_started() -> bool:
    """Ray is initialised in this process (without importing it: importing reads RAY_AUTH_MODE)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def local_node() -> NodeResources:
    """This machine as the local Ray instance the CLI starts will declare it: its CPUs (at least
    2, so a rank and a server fit on a 1-core machine) and its CUDA GPUs."""
    import torch

    cpus = max(os.cpu_count() or 1, 2)
    return NodeResources("local", "127.0.0.1", cpus, torch.cuda.device_count())


@contextlib.contextmanager
def _no_second_interrupt(active: bool) -> Iterator[None]:
    """Ignore Ctrl-C while closing the pieces after a first one (a second would leave Ray and
    the engine half-closed and print a traceback)."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def execute(config: RunConfig, notes: Sequence[str] = ()) -> RunResult:
    """Run one configured job to the end; the pieces are closed whatever happens. ``notes`` go
    to the run's log first (what :func:`~rlcore.config.flags.load_config` reported taking from a
    checkpoint).

    Raises :class:`ConfigError` / :class:`PlanError` before anything starts when the paths, data
    or checkpoint cannot make the run (removing the folders it created), the rlcore error of a
    failing component, and :class:`RunInterrupted` after Ctrl-C (``summary.json`` written).
    """
    created = preflight(config)
    try:
        tokenizer = _tokenizer(config)
        data = load_run_data(config, tokenizer)
        if not config.is_eval_only:
            config = resolve_num_rollout(config, len(data.train_prompts))
        the_plan = plan(config)
        reward_fn = with_env_reward(
            get_reward_fn(config.data.rm_type, config.data.custom_rm_path),
            config.multiturn.env_reward,
        )
        check_user_functions(config)
        check_inputs(the_plan, data)
        if isinstance(the_plan, TrainPlan):
            resume_point(the_plan)
        request = placement_request(config, the_plan)
        if config.ray_address is None and not _ray_started():
            # The local instance will hold exactly this machine: refuse a run that cannot fit
            # now, before Ray starts. (A joined cluster is checked as Ray reports it, in
            # reserve().)
            plan_layout(request, [local_node()])
    except BaseException:
        remove_folders(created)
        raise
    c = config.checkpoint
    resumes = isinstance(the_plan, TrainPlan) and c.load is not None and not c.finetune
    earlier_run = start_output_folder(config.output_dir, continues=resumes)
    setup_logging(config.output_dir / "run.log")
    log.info("plan: %s, output in %s", type(the_plan).__name__, config.output_dir)
    if earlier_run is not None:
        log.info("output: the files of the run that wrote here before moved to %s", earlier_run)
    if c.overwrite_save and c.save is not None and (removed := remove_earlier_checkpoints(c.save)):
        log.info("checkpoints: --overwrite-save removed %s", ", ".join(p.name for p in removed))
    for note in notes:
        log.info("%s", note)

    if config.ray_address is None and "ray" not in sys.modules:
        # Token authentication stays on (Ray's default for a cluster it starts), said explicitly
        # so that Ray does not warn about it on every run. Ray reads it when it is imported.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    from rlcore_megatron.cluster import ClusterPlacement
    from rlcore_megatron.ray_stacks import RayMegatronBackend

    watchdog = watch_tree()  # kills what this run started if this process is killed
    started_ray = not ray.is_initialized()
    placement: ClusterPlacement | None = None
    backend: RayMegatronBackend | None = None
    engine: RolloutEngine | None = None
    sink: MetricsSink | None = None
    interrupted: RunInterrupted | None = None
    failure: BaseException | None = None
    progress = Progress()
    result = progress.result(interrupted=False)
    try:
        _start_ray(config)
        sink = _sinks(config, the_plan)
        # Every slot of the run is reserved (or refused) before any rank or server starts.
        placement = ClusterPlacement.reserve(request)
        if placement.driver_threads is not None:
            _engine_threads(placement.driver_threads)
        backend = RayMegatronBackend(placement)
        # Replaying saved rollouts (--load-debug-rollout-data) needs no engine.
        replays = config.debug.replays
        engine = None if replays else make_engine(config, tokenizer, placement.start_hosts())
        engine = episodes(config, engine, tokenizer)
        result = run(the_plan, backend, engine, reward_fn, data, sink, progress=progress)
    except RunInterrupted as exc:
        interrupted = exc
        result = exc.result
    except KeyboardInterrupt:  # before the loop started
        result = RunResult((), (), (), {}, {}, interrupted=True)
        interrupted = RunInterrupted(result)
    except BaseException as exc:
        failure = exc
        result = progress.result(interrupted=False)
        log_to_file(logging.ERROR, f"run failed: {type(exc).__name__}: {exc}")
        raise
    finally:
        with _no_second_interrupt(active=interrupted is not None):
            if sink is not None:
                sink.close()
            if engine is not None:
                engine.close()
            if backend is not None:
                backend.close()
            if placement is not None:
                placement.close()
            if started_ray:
                ray.shutdown()
            if watchdog is not None:
                watchdog.stop()
        try:
            write_summary(config.output_dir / "summary.json", result, config, failure)
        except OSError as exc:  # a full disk, say: the run's own error matters more
            log.warning("could not write summary.json: %s", exc)
    if interrupted is not None:
        raise interrupted
    return result


def _engine_threads(threads: int) -> None:
    """torch threads of this process: its rollout engine's share of the machine, so that it
    generates beside the ranks instead of competing with them for every core."""
    import torch

    torch.set_num_threads(threads)
    log.info("rollout engine in this process: %d torch thread(s)", threads)


def _offline_and_quiet() -> None:
    """This process and what it starts (Ray's workers, SGLang servers) read model folders from
    disk only and draw no download progress bars."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code: 2 for configuration problems (the flags, the
    paths or the data cannot make a run), 1 for run errors, 130 after Ctrl-C."""
    args = list(sys.argv[1:] if argv is None else argv)
    _offline_and_quiet()
    parser = build_parser(description=DESCRIPTION)
    config: RunConfig | None = None
    try:
        if not args:
            from rlcore_megatron.demo import demo_flags, prepare_demo

            prepare_demo(DEMO_FOLDER)
            args = demo_flags(DEMO_FOLDER)
            print(
                f"No flags: running the CPU demo in {DEMO_FOLDER} (see --help for the real thing).",
                file=sys.stderr,
            )
        notes: list[str] = []
        config = load_config(args, parser, report=notes)
        for note in notes:  # what an eval-only run took from its checkpoint
            print(note, file=sys.stderr)
        result = execute(config, notes)
    except (ConfigError, PlanError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RLCoreError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except RunInterrupted as exc:
        assert config is not None  # only execute() raises it
        print(interrupted_message(exc.result, config), file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted before the run started", file=sys.stderr)
        return 130
    evals = {k: round(v, 4) for k, v in result.last_eval.items()}
    if result.trained:
        trained = f"rollouts {result.trained[0]}..{result.trained[-1]}"
    elif result.rollouts:
        trained = f"nothing (rollout-only: rollouts {result.rollouts[0]}..{result.rollouts[-1]})"
    else:
        trained = "nothing (eval-only)"
    print(
        f"done: trained {trained}, saved {list(result.saved)}, built {list(result.built)}, "
        f"last eval {evals}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
