"""``python -m rlcore_megatron.run``: flags or ``--config`` -> RunConfig -> plan -> Ray -> Megatron
stacks in train groups -> rollout engine -> the core loop.

With no flags at all it runs the self-contained CPU demo (:mod:`rlcore_megatron.demo`).

Fail fast, leave nothing behind: :func:`~rlcore_megatron.prepare.prepare` checks everything it
can before Ray or any model starts (a problem there exits with 2, and the folders it created are
removed); :func:`launch` starts and runs the job (an error then exits with 1). Nothing is
downloaded: model folders are local (``HF_HUB_OFFLINE``). A watchdog kills what the run started
if the driver is killed; Ctrl-C stops cleanly and exits with 130. Every run that starts leaves
``summary.json`` (:mod:`rlcore_megatron.run_record`).

Metrics go to ``OUTPUT_DIR/metrics.jsonl`` (and TensorBoard / wandb when asked); the log to
``OUTPUT_DIR/run.log`` and the console.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from rlcore.checkpoint_files import find_checkpoint, rollout_number
from rlcore.config import RunConfig
from rlcore.config.flags import build_parser, load_config, read_settings
from rlcore.data import HFTokenizer
from rlcore.engines import EngineSetup, load_engine
from rlcore.errors import ConfigError, PlanError, RLCoreError, causes
from rlcore.loop import RunInterrupted, RunResult, resume_point, run
from rlcore.loop.metrics import JsonlSink, MultiSink, StepsFrom, TensorBoardSink
from rlcore.loop.plan import Plan, RolloutOnlyPlan, TrainPlan
from rlcore.loop.preflight import remove_earlier_checkpoints, rewind_checkpoints
from rlcore.loop.records import Progress
from rlcore.protocols import MetricsSink, ProcessHost, RolloutEngine
from rlcore.rollout.multiturn import (
    EpisodeEngine,
    load_custom_generate_function,
    load_environment_factory,
)
from rlcore.specs import Precision
from rlcore_megatron.console import ProgressSink, WandbSink, log_to_file, setup_logging
from rlcore_megatron.prepare import Prepared, local_node, placement_problem, prepare
from rlcore_megatron.run_record import (
    EXIT_CODES,
    Status,
    begin_attempt,
    mark_restarted,
    outcome_lines,
    record_early_exit,
    restart_config,
    rewind_metrics,
    start_output_folder,
    status_of,
    write_summary,
)
from rlcore_megatron.watchdog import watch_tree

__all__ = [
    "engine_dtype",
    "episodes",
    "execute",
    "launch",
    "launch_restarting",
    "main",
    "make_engine",
    "stop_on_signals",
]

log = logging.getLogger("rlcore")

DEMO_FOLDER = Path("runs/demo")
DESCRIPTION = (
    "RL post-training with a Megatron backend, Ray and a rollout engine. With no flags, runs a "
    "small self-contained demo on the CPU. Flags keep slime's names; --config reads a TOML file "
    "(sections as below) and flags override it. --num-rollout 0 evaluates only."
)


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


def _sinks(config: RunConfig, the_plan: Plan, resumed_at: int | None = None) -> MetricsSink:
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


def _rewind(config: RunConfig, the_plan: Plan, resumed_from: Path | None) -> int | None:
    """Take a resumed run back to the checkpoint it loads, ``resumed_from``: with
    ``--rewind-save`` the save folder's later checkpoints move aside
    (:func:`~rlcore.loop.preflight.rewind_checkpoints`), and on every resume (a restart's too)
    the metrics rows logged past it (:func:`~rlcore_megatron.run_record.rewind_metrics`); each
    said in the log. Returns the first step the run logs anew (for the sinks that keep their own
    history), ``None`` for a run that does not resume."""
    if not isinstance(the_plan, TrainPlan) or resumed_from is None:
        return None
    c = config.checkpoint
    if c.rewind_save and c.save is not None:
        moved, folder = rewind_checkpoints(c.save, resumed_from)
        if moved:
            log.info(
                "checkpoints: --rewind-save moved %s (past %s, which this run resumes from) to %s",
                ", ".join(p.name for p in moved),
                resumed_from.name,
                folder,
            )
    first = resume_point(the_plan).first
    rewound = rewind_metrics(config.output_dir, first, evaluates_again=the_plan.eval_before_train)
    if rewound.moved:
        log.info("%s", rewound)
    return rollout_number(first)


def _not_the_token_notice(record: logging.LogRecord) -> bool:
    """Ray's notice that a cluster it starts has token authentication (its default, which a run
    keeps): there is nothing to do about it, so it is dropped; Ray's other warnings stay (the
    one that a cluster has none, which asks for a token, among them)."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray")


def _start_ray(config: RunConfig) -> None:
    """Join ``--ray-address`` or start a local instance of this machine, logging how long it
    took."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(
        _not_the_token_notice
    )
    import ray

    from rlcore_megatron.ray_group import RayGroupError

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


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""Preemption (``kill``, ``scancel``, a Kubernetes eviction) and SLURM's ``--signal=USR1@T``."""


@contextlib.contextmanager
def stop_on_signals(progress: Progress) -> Iterator[None]:
    """The first SIGTERM or SIGUSR1 asks the run to stop once the rollout being trained is
    saved (:attr:`Progress.stop`); a second one stops it at once, as Ctrl-C does, however soon
    it follows the first.

    Python runs a signal's handler once for every delivery that came before it could run (a flag
    per signal, set by the C-level handler): while the driver waits in a call that checks for
    signals only now and then (``ray.get`` does about once a second), two SIGTERMs 50 ms apart
    reached the handler as one. CPython's C-level handler also writes the number of every
    signal it receives to the wakeup file descriptor (:func:`signal.set_wakeup_fd`), so the
    handler counts the deliveries there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    deliveries, wakeup = os.pipe()
    for fd in (deliveries, wakeup):
        os.set_blocking(fd, False)
    counted = {int(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}

    def arrived() -> int:
        """The stop signals delivered since the handler last ran."""
        numbers = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(deliveries, 4096):
                numbers += chunk
        return max(1, sum(number in counted for number in numbers))

    def handler(signum: int, frame: object) -> None:
        del frame
        name = signal.Signals(signum).name
        if progress.stop.is_set() or arrived() > 1:
            log.warning("%s again: the run stops at once, without saving", name)
            raise KeyboardInterrupt
        progress.stop.set()
        log.warning(
            "%s: the run stops once the rollout being trained is saved (send it again to stop "
            "at once, without saving)",
            name,
        )

    previous_wakeup = signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        signal.set_wakeup_fd(previous_wakeup)
        os.close(deliveries)
        os.close(wakeup)


def execute(config: RunConfig, notes: Sequence[str] = ()) -> RunResult:
    """Run ``config`` on the Megatron backend to the end, as ``python -m rlcore_megatron.run``
    does (``rlcore.execute(config, backend="megatron")`` calls this): the checks before start
    (:func:`prepare`; the data are read once, there), Ray, the ranks and the rollout engine,
    ``metrics.jsonl``, ``run.log`` and ``summary.json`` in ``config.output_dir``, checkpoints,
    and ``--max-restarts`` (:func:`launch_restarting`). Model folders are read from disk only
    (``HF_HUB_OFFLINE=1`` for this process and what it starts). ``notes`` go to the run's log
    first (what :func:`~rlcore.config.flags.load_config` reported taking from a checkpoint).

    Raises what :func:`prepare` finds before anything starts (:class:`ConfigError`,
    :class:`PlanError`, :class:`~rlcore.errors.DataError`, ...), the rlcore error of a
    component that fails later, and :class:`~rlcore.loop.RunInterrupted` after Ctrl-C; a run
    stopped by SIGTERM returns with ``result.stopped``."""
    _offline_and_quiet()
    return launch_restarting(prepare(config), notes)


def launch_restarting(prepared: Prepared, notes: Sequence[str] = ()) -> RunResult:
    """:func:`launch`, and with ``--max-restarts N`` up to N more times when a training rank is
    lost (:class:`~rlcore_megatron.ray_group.RankLostError`): every piece is closed, then the run
    is prepared again from the latest checkpoint in ``--save`` (a resume, which sets aside the
    metrics rows logged after it) or, with none yet, from its start. Each restart is logged, and
    counted in ``summary.json``."""
    from rlcore_megatron.ray_group import RankLostError

    restarts = 0
    while True:
        try:
            return launch(prepared, notes, restarts=restarts)
        except RLCoreError as exc:
            # A rank lost during a save reaches here as the save's CheckpointError, from it.
            lost = next((e for e in causes(exc) if isinstance(e, RankLostError)), None)
            limit = prepared.config.checkpoint.max_restarts
            if lost is None or restarts >= limit:
                raise
            restarts += 1
            config, through = restart_config(prepared.config)
            if through is None:
                where = "from the start: no checkpoint yet"
            else:  # (launch cuts the metrics back to it, as for every resume)
                where = f"from {config.checkpoint.load} after rollout {through}"
            reason = str(lost).splitlines()[0]
            restart = f"restart {restarts} of {limit} ({reason}): {where}"
            log.warning("%s", restart)
            mark_restarted(config.output_dir / "summary.json", restart)
            prepared = prepare(config)


def launch(prepared: Prepared, notes: Sequence[str] = (), restarts: int = 0) -> RunResult:
    """Start and run a prepared job to the end; the pieces are closed whatever happens.
    ``notes`` go to the run's log first (what :func:`~rlcore.config.flags.load_config` reported
    taking from a checkpoint); ``restarts`` counts the earlier attempts (for ``summary.json``).

    Raises the rlcore error of a failing component and :class:`RunInterrupted` after Ctrl-C;
    ``summary.json`` is written either way.
    """
    config, the_plan, tokenizer = prepared.config, prepared.plan, prepared.tokenizer
    data, reward_fn, request = prepared.data, prepared.reward_fn, prepared.request
    c = config.checkpoint
    resumes = isinstance(the_plan, TrainPlan) and c.load is not None and not c.finetune
    resumed_from = find_checkpoint(c.load) if resumes and c.load is not None else None
    earlier_run = start_output_folder(config.output_dir, continues=resumes)
    setup_logging(config.output_dir / "run.log")
    begin_attempt(config, resumed_from, restarts)
    log.info("plan: %s, output in %s", type(the_plan).__name__, config.output_dir)
    if earlier_run is not None:
        log.info("output: the files of the run that wrote here before moved to %s", earlier_run)
    if c.overwrite_save and c.save is not None and (removed := remove_earlier_checkpoints(c.save)):
        log.info("checkpoints: --overwrite-save removed %s", ", ".join(p.name for p in removed))
    for note in notes:
        log.info("%s", note)
    for note in prepared.notes:
        log.warning("%s", note)
    resumed_at = _rewind(config, the_plan, resumed_from)

    import ray

    from rlcore.backends import load_backend_kind
    from rlcore_megatron.cluster import ClusterPlacement
    from rlcore_megatron.ray_stacks import RayBackend

    watchdog = watch_tree()  # kills what this run started if this process is killed
    started_ray = not ray.is_initialized()
    placement: ClusterPlacement | None = None
    backend: RayBackend | None = None
    engine: RolloutEngine | None = None
    sink: MetricsSink | None = None
    interrupted: RunInterrupted | None = None
    failure: BaseException | None = None
    progress = Progress()
    result = progress.result(interrupted=False)
    try:
        _start_ray(config)
        sink = _sinks(config, the_plan, resumed_at)
        # Every slot of the run is reserved (or refused) before any rank or server starts.
        placement = ClusterPlacement.reserve(request)
        if placement.driver_threads is not None:
            _engine_threads(placement.driver_threads)
        backend = RayBackend(load_backend_kind("megatron").rank_runtime(None), placement)
        # Replaying saved rollouts (--load-debug-rollout-data) needs no engine.
        replays = config.debug.replays
        engine = None if replays else _timed_engine(config, tokenizer, placement.start_hosts())
        engine = episodes(config, engine, tokenizer)
        with stop_on_signals(progress):
            result = run(
                the_plan,
                backend,
                engine,
                reward_fn,
                data,
                sink,
                progress=progress,
                teacher=prepared.teacher,
            )
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
        lines = outcome_lines(result, config, failure)
        if failure is None:  # (a failure's error ends the log already)
            for line in lines:
                log_to_file(logging.WARNING if result.stopped else logging.INFO, line)
        try:
            write_summary(
                config.output_dir / "summary.json",
                result,
                config,
                failure,
                restarts,
                resumed_from=resumed_from,
                message="\n".join(lines),
            )
        except OSError as exc:  # a full disk, say: the run's own error matters more
            log.warning("could not write summary.json: %s", exc)
    if interrupted is not None:
        raise interrupted
    return result


def _timed_engine(
    config: RunConfig, tokenizer: HFTokenizer, hosts: Sequence[ProcessHost]
) -> RolloutEngine:
    """:func:`make_engine`, logging how long it took (loading the model, starting servers)."""
    started = time.monotonic()
    engine = make_engine(config, tokenizer, hosts)
    log.info(
        "rollout engine: %s, ready (%.1f s)", config.rollout.engine, time.monotonic() - started
    )
    return engine


def _engine_threads(threads: int) -> None:
    """torch threads of this process: its rollout engine's share of the machine, so that it
    generates beside the ranks instead of competing with them for every core."""
    import torch

    torch.set_num_threads(threads)
    log.info("rollout engine in this process: %d torch thread(s)", threads)


def _interruptible() -> None:
    """Ctrl-C (SIGINT) stops the run however it was started. A background job of a
    non-interactive shell (a CI script, ``cmd &`` in a script) inherits SIGINT *ignored*, and
    Python then installs no ``KeyboardInterrupt`` handler: ``kill -INT`` was lost and the run
    trained to its end (the "lost SIGINT" of the Ctrl-C test, which failed only where CI
    started it so)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _offline_and_quiet() -> None:
    """This process and what it starts (Ray's workers, SGLang servers) read model folders from
    disk only and draw no download progress bars."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code: 2 for a problem found before anything starts
    (the flags, the paths, the data, a checkpoint, ranks that do not fit this machine), 1 for an
    error once the run has started, 130 after Ctrl-C, 143 after SIGTERM or SIGUSR1 (stopped
    once the rollout being trained was saved)."""
    args = list(sys.argv[1:] if argv is None else argv)
    _offline_and_quiet()
    _interruptible()
    parser = build_parser(description=DESCRIPTION)
    try:
        if not args:
            from rlcore_megatron.demo import demo_flags, prepare_demo

            print(
                f"No flags: running the CPU demo in {DEMO_FOLDER} (see --help for the real thing).",
                file=sys.stderr,
            )

            prepare_demo(DEMO_FOLDER)
            args = demo_flags(DEMO_FOLDER)
        notes: list[str] = []
        config = load_config(args, parser, report=notes)
        for note in notes:  # what an eval-only run took from its checkpoint
            print(note, file=sys.stderr)
        prepared = prepare(config)
    except (ConfigError, PlanError) as exc:
        # Ranks that cannot fit this machine first: no other fix would make the run start.
        with contextlib.suppress(ConfigError):  # a file that cannot be read: said below
            unplaceable = placement_problem(read_settings(args, parser))
            if unplaceable is not None:
                print(f"error: {type(unplaceable).__name__}: {unplaceable}", file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        _early_exit(args, parser, "refused", exc, f"error: {exc}")
        return 2
    except RLCoreError as exc:  # the data, the placement: found before anything started
        message = f"error: {type(exc).__name__}: {exc}"
        print(message, file=sys.stderr)
        _early_exit(args, parser, "refused", exc, message)
        return 2
    except KeyboardInterrupt:
        print("interrupted before the run started", file=sys.stderr)
        _early_exit(args, parser, "interrupted", None, "interrupted before the run started")
        return 130
    failure: RLCoreError | None = None
    try:
        result = launch_restarting(prepared, notes)
    except RLCoreError as exc:
        failure, result = exc, RunResult((), (), (), {}, {})
    except RunInterrupted as exc:
        result = exc.result
    for line in outcome_lines(result, prepared.config, failure):
        print(line, file=sys.stderr)
    return EXIT_CODES[status_of(result, failure)]


def _early_exit(
    args: Sequence[str],
    parser: argparse.ArgumentParser,
    status: Status,
    error: BaseException | None,
    message: str,
) -> None:
    """The record of a run that ends before it starts, in the output folder its flags name
    (:func:`~rlcore_megatron.run_record.record_early_exit`), when they can be read at all."""
    try:
        given = read_settings(args, parser).get("output_dir")
    except ConfigError:
        return  # the --config file cannot be read: no output folder is known
    default = attrs.fields(RunConfig).output_dir.default  # (runs/latest)
    output_dir = Path(given) if isinstance(given, str) else default
    if output_dir is None:
        return
    try:
        record_early_exit(output_dir, status, error, message)
    except OSError as exc:  # the record matters less than saying why the run did not start
        print(f"could not write {output_dir / 'summary.json'}: {exc}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
