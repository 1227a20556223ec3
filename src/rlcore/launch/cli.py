"""``python -m rlcore.launch`` (and ``python -m rlcore_megatron.run``, the same entry): flags or
``--config`` -> RunConfig -> plan -> Ray -> the training backend's stacks in rank groups (its kind,
``--train-backend``, found by name) -> rollout engine -> the core loop.

With no flags at all (or only ``--train-backend``) it runs the self-contained CPU demo
(:mod:`rlcore.launch.demo`).

Fail fast, leave nothing behind: :func:`~rlcore.launch.prepare.prepare` checks everything it
can before Ray or any model starts (a problem there exits with 2, and the folders it created are
removed); :func:`launch` starts and runs the job (an error then exits with 1). Nothing is
downloaded: model folders are local (``HF_HUB_OFFLINE``). A watchdog kills what the run started
if the driver is killed; Ctrl-C stops cleanly and exits with 130. Every run that starts leaves
``summary.json`` (:mod:`rlcore.launch.record`).

Metrics go to ``OUTPUT_DIR/metrics.jsonl`` (and TensorBoard / wandb when asked); the log to
``OUTPUT_DIR/run.log`` and the console.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from rlcore.checkpoint_files import find_checkpoint, rollout_number
from rlcore.config import RunConfig
from rlcore.config.flags import build_parser, load_config, read_settings
from rlcore.errors import ConfigError, PlanError, RLCoreError, causes
from rlcore.launch.console import log_to_file, setup_logging
from rlcore.launch.pieces import (
    episodes,
    set_engine_threads,
    start_ray,
    start_sinks,
    timed_engine,
)
from rlcore.launch.prepare import Prepared, placement_problem, prepare
from rlcore.launch.record import (
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
from rlcore.launch.signals import interruptible, no_second_interrupt, stop_on_signals
from rlcore.launch.watchdog import watch_tree
from rlcore.loop import RunInterrupted, RunResult, resume_point, run
from rlcore.loop.plan import Plan, TrainPlan
from rlcore.loop.preflight import remove_earlier_checkpoints, rewind_checkpoints
from rlcore.loop.records import Progress
from rlcore.protocols.engine import RolloutEngine
from rlcore.protocols.metrics import MetricsSink

__all__ = ["execute", "launch", "launch_restarting", "main"]

log = logging.getLogger("rlcore")

DEMO_FOLDER = Path("runs/demo")
DESCRIPTION = (
    "RL post-training with a training backend (--train-backend, default megatron), Ray and a "
    "rollout engine. With no flags (or only --train-backend), runs a small self-contained demo "
    "on the CPU. Flags keep slime's names; --config reads a TOML file (sections as below) and "
    "flags override it. --num-rollout 0 evaluates only."
)


def _rewind(config: RunConfig, the_plan: Plan, resumed_from: Path | None) -> int | None:
    """Take a resumed run back to the checkpoint it loads, ``resumed_from``: with
    ``--rewind-save`` the save folder's later checkpoints move aside
    (:func:`~rlcore.loop.preflight.rewind_checkpoints`), and on every resume (a restart's too)
    the metrics rows logged past it (:func:`~rlcore.launch.record.rewind_metrics`); each
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


def execute(config: RunConfig, notes: Sequence[str] = ()) -> RunResult:
    """Run ``config`` to the end, as ``python -m rlcore.launch`` does, on the backend it names
    (``--train-backend``; ``rlcore.execute(config)`` calls this): the checks before start
    (:func:`prepare`; the data are read once, there), Ray, the backend's ranks and the rollout
    engine, ``metrics.jsonl``, ``run.log`` and ``summary.json`` in ``config.output_dir``,
    checkpoints, and ``--max-restarts`` (:func:`launch_restarting`). Model folders are read from
    disk only (``HF_HUB_OFFLINE=1`` for this process and what it starts). ``notes`` go to the
    run's log first (what :func:`~rlcore.config.flags.load_config` reported taking from a
    checkpoint).

    Raises what :func:`prepare` finds before anything starts (:class:`ConfigError`,
    :class:`PlanError`, :class:`~rlcore.errors.DataError`, ...), the rlcore error of a
    component that fails later, and :class:`~rlcore.loop.RunInterrupted` after Ctrl-C; a run
    stopped by SIGTERM returns with ``result.stopped``."""
    _offline_and_quiet()
    return launch_restarting(prepare(config), notes)


def launch_restarting(prepared: Prepared, notes: Sequence[str] = ()) -> RunResult:
    """:func:`launch`, and with ``--max-restarts N`` up to N more times when a training rank is
    lost (:class:`~rlcore.launch.ray.ranks.RankLostError`): every piece is closed, then the run
    is prepared again from the latest checkpoint in ``--save`` (a resume, which sets aside the
    metrics rows logged after it) or, with none yet, from its start. Each restart is logged, and
    counted in ``summary.json``."""
    from rlcore.launch.ray.ranks import RankLostError

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
    from rlcore.launch.ray.cluster import ClusterPlacement
    from rlcore.launch.ray.stacks import RayBackend

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
        start_ray(config)
        sink = start_sinks(config, the_plan, resumed_at)
        # Every slot of the run is reserved (or refused) before any rank or server starts.
        placement = ClusterPlacement.reserve(request)
        if placement.driver_threads is not None:
            set_engine_threads(placement.driver_threads)
        kind = load_backend_kind(config.model.train_backend)
        options = config.model.backend_options
        backend = RayBackend(
            kind.rank_runtime(options),
            placement,
            model_owner=functools.partial(kind.owner_of, options),
        )
        # Replaying saved rollouts (--load-debug-rollout-data) needs no engine.
        replays = config.debug.replays
        engine = None if replays else timed_engine(config, tokenizer, placement.start_hosts())
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
        with no_second_interrupt(active=interrupted is not None):
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


def _offline_and_quiet() -> None:
    """This process and what it starts (Ray's workers, SGLang servers) read model folders from
    disk only and draw no download progress bars."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _only_a_backend(args: Sequence[str]) -> bool:
    """No flags, or only ``--train-backend NAME``: the demo, on that backend."""
    return not args or (len(args) == 2 and args[0] == "--train-backend")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code: 2 for a problem found before anything starts
    (the flags, the paths, the data, a checkpoint, ranks that do not fit this machine), 1 for an
    error once the run has started, 130 after Ctrl-C, 143 after SIGTERM or SIGUSR1 (stopped
    once the rollout being trained was saved)."""
    args = list(sys.argv[1:] if argv is None else argv)
    _offline_and_quiet()
    interruptible()
    parser = build_parser(description=DESCRIPTION)
    try:
        if _only_a_backend(args):
            from rlcore.launch.demo import demo_flags, prepare_demo

            print(
                f"No flags: running the CPU demo in {DEMO_FOLDER} (see --help for the real thing).",
                file=sys.stderr,
            )

            prepare_demo(DEMO_FOLDER)
            args = demo_flags(DEMO_FOLDER) + args
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
    (:func:`~rlcore.launch.record.record_early_exit`), when they can be read at all."""
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
