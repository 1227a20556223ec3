"""The save and resume stages: checkpoint folders written atomically (their layout:
:mod:`rlcore.checkpoint_files`), and where a resumed run starts.

A save is built in a hidden temporary folder, renamed into place, and only then is ``latest``
replaced (by ``os.replace`` of a temporary file). A crash or an exception at any point leaves the
previous checkpoint as ``latest``: a failed save never replaces a good one. A killed process
cannot remove its temporary folder (a whole checkpoint's size), so every save first removes the
ones an earlier, interrupted save left behind, and logs each: a save folder belongs to one run at
a time.

Disk space: before writing, a save compares the free space of the save folder's disk with the
size of the previous checkpoint and refuses at once when it cannot fit (``not enough space on
the disk holding ...``); a save that fails on a full disk anyway says so (``no space left on the
device holding ...``), whatever the writer's own error says, and names the checkpoint kept.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import attrs

from rlcore.checkpoint_files import (
    INTERRUPTED_SAVES,
    LATEST_FILE,
    META_FILE,
    CheckpointMeta,
    find_checkpoint,
    read_meta,
    rollout_dir_name,
    rollout_number,
    saved_checkpoints,
    write_manifest,
)
from rlcore.config import RunConfig, with_flag
from rlcore.config.resume import SettingChange, refusal, resume_changes, saved_config
from rlcore.errors import CheckpointError, ConfigError, ConfigProblem, PlanError, causes
from rlcore.loop.plan import TrainPlan
from rlcore.loop.stages import TrainStacks
from rlcore.protocols.rollout import Group, RolloutOutput
from rlcore.protocols.stacks import TrainingStack
from rlcore.rollout.replay import read_groups, read_output, write_groups, write_output

__all__ = [
    "CARRIED_FILE",
    "PENDING_FOLDER",
    "ResumePoint",
    "Resumed",
    "read_carried",
    "read_pending",
    "remove_interrupted_saves",
    "resume",
    "resume_point",
    "retire_old_checkpoints",
    "save_checkpoint",
    "write_checkpoint",
    "write_folder",
]

log = logging.getLogger("rlcore")


def _fsync_write(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(
    root: Path,
    meta: CheckpointMeta,
    save_stacks: Mapping[str, Callable[[Path], None]],
    *,
    retain: int | None = None,
    keep: Path | None = None,
) -> Path:
    """Save every stack (``save_stacks[name](folder)``, each given a folder of its own that this
    function has created, empty) into one new checkpoint, atomically.

    Returns the final folder. On any failure the temporary folder is removed, ``latest`` is left
    as it was, and :class:`CheckpointError` (naming the folder) is raised from the cause. Ctrl-C
    (or any ``BaseException``) during the save cleans up the same way and goes on up as it is.

    ``retain``: once the new checkpoint is ``latest``, only the newest ``retain`` checkpoints
    stay (:func:`retire_old_checkpoints`), never ``keep`` (the one the run loaded).
    """
    root.mkdir(parents=True, exist_ok=True)
    remove_interrupted_saves(root)
    name = rollout_dir_name(rollout_number(meta.rollout_id))
    final = root / name
    _check_space(root, name)

    def fill(tmp: Path) -> None:
        for stack_name, save in save_stacks.items():
            part = tmp / stack_name
            part.mkdir()
            save(part)
        write_manifest(tmp)
        _fsync_write(tmp / META_FILE, json.dumps(attrs.asdict(meta), indent=1))

    write_folder(
        final,
        fill,
        "checkpoint",
        kept=lambda: _kept(root),
        hint="Free some space or point --save at a bigger disk",
    )
    try:
        pointer = root / f".{LATEST_FILE}.tmp"
        _fsync_write(pointer, name + "\n")
        os.replace(pointer, root / LATEST_FILE)
    except OSError as exc:
        raise CheckpointError(
            f"saving checkpoint {final} failed: could not point {root / LATEST_FILE} at it: {exc}"
        ) from exc
    if retain is not None:
        retire_old_checkpoints(root, retain, keep=keep)
    return final


def write_folder(
    final: Path, fill: Callable[[Path], None], what: str, *, kept: Callable[[], str], hint: str
) -> Path:
    """Build the folder ``final`` by ``fill(tmp)`` (``tmp`` a hidden sibling, created empty) and
    rename it into place; an earlier ``final`` is replaced only once the new one is complete.

    On any failure the temporary folder is removed, an earlier ``final`` stays, and
    :class:`CheckpointError` names ``what`` and the folder; on a full disk it says so, whatever
    the writer said, with ``kept()`` (what is still there) and ``hint`` (what to do). Ctrl-C (or
    any ``BaseException``) cleans up the same way and goes on up as it is. Returns ``final``.
    """
    root = final.parent
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    old = root / f".old-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        fill(tmp)
        if final.exists():  # re-saving the same folder: move the old one aside first
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException as exc:
        full = isinstance(exc, Exception) and _disk_full(root, exc)  # before freeing tmp's space
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not final.exists():  # stopped between the two renames
            old.rename(final)
        if not isinstance(exc, Exception):
            raise
        if full:
            raise CheckpointError(
                f"saving {what} {final} failed: no space left on the device holding {root} "
                f"({_size(shutil.disk_usage(root).free)} free once its partial files were "
                f"removed); {kept()}. {hint}. The writer said: {exc}"
            ) from exc
        raise CheckpointError(f"saving {what} {final} failed: {exc}") from exc
    return final


def retire_old_checkpoints(root: Path, retain: int, keep: Path | None = None) -> list[Path]:
    """Remove all but the newest ``retain`` complete checkpoints in ``root`` (and never
    ``keep``); returns what it removed. Each goes by a rename to a hidden name first, so that a
    kill half-way through leaves a folder the next save removes, not a damaged checkpoint."""
    complete = [p for p in saved_checkpoints(root) if (p / META_FILE).is_file()]
    protected = {keep.resolve()} if keep is not None else set()
    retired = []
    for folder in complete[: max(len(complete) - retain, 0)]:
        if folder.resolve() in protected:
            continue
        hidden = root / f".old-{folder.name}-{os.getpid()}"
        folder.rename(hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        log.info("checkpoints: removed %s (--save-retain %d)", folder, retain)
        retired.append(folder)
    return retired


_FULL_BELOW = 16 * 2**20
"""Free bytes under which a disk counts as full when a save has just failed on it."""


def _disk_full(root: Path, exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is ENOSPC, or the disk is as good as full now."""
    for seen in causes(exc):
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(seen):
            return True
    return shutil.disk_usage(root).free < _FULL_BELOW


def _check_space(root: Path, name: str) -> None:
    """Refuse a save that cannot fit: the previous checkpoint's size against the free space."""
    try:
        previous = find_checkpoint(root)
    except CheckpointError:
        return  # the first save: nothing to go by
    need = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file())
    free = shutil.disk_usage(root).free
    if need > free:
        raise CheckpointError(
            f"not enough space on the disk holding {root} for checkpoint {name}: it needs about "
            f"{_size(need)} (the size of {previous.name}) and {_size(free)} is free; "
            f"{_kept(root)}. Free some space or point --save at a bigger disk"
        )


def _kept(root: Path) -> str:
    try:
        return f"the latest checkpoint is still {find_checkpoint(root)}"
    except CheckpointError:
        return "no earlier checkpoint was written"


def _size(n: int) -> str:
    value, unit = float(n), "bytes"
    for bigger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"


def remove_interrupted_saves(root: Path) -> list[Path]:
    """Remove what interrupted saves left in the save folder ``root`` (their temporary folders);
    returns the paths removed, each also logged."""
    removed = []
    for pattern in INTERRUPTED_SAVES:
        for path in sorted(root.glob(pattern)):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            log.info("checkpoints: removed %s, left behind by an interrupted save", path)
            removed.append(path)
    return removed


# --------------------------------------------------------------------------------------------
# The save stage


def save_checkpoint(
    plan: TrainPlan,
    stacks: TrainStacks,
    rollout_id: int,
    consumed: int,
    carried: tuple[Group, ...],
    pending: Mapping[int, RolloutOutput] | None = None,
    keep: Path | None = None,
) -> Path:
    """The save stage: every training stack, the prompt position ``consumed``, the groups
    ``carried`` into the next rollout to generate, the rollouts generated ahead of training
    (``pending``) and the run's settings, as checkpoint ``rollout_id`` in ``plan.save_dir``,
    written atomically (:func:`~rlcore.loop.checkpoints.write_checkpoint`); with
    ``plan.save_retain`` older checkpoints go, never ``keep`` (the one the run loaded). Returns
    its folder."""
    assert plan.save_dir is not None  # should_save is True only with a save folder
    meta = CheckpointMeta(rollout_id, consumed, tuple(stacks.training()), plan.settings)
    savers = _savers(stacks, rollout_id, carried, pending or {})
    return write_checkpoint(plan.save_dir, meta, savers, retain=plan.save_retain, keep=keep)


def _savers(
    stacks: TrainStacks,
    rollout_id: int,
    carried: tuple[Group, ...],
    pending: Mapping[int, RolloutOutput],
) -> dict[str, Callable[[Path], None]]:
    def saver(stack: TrainingStack) -> Callable[[Path], None]:
        return lambda folder: stack.save(folder, rollout_id)

    def save_rollouts(folder: Path) -> None:
        if carried:  # kept surplus groups: the next rollout starts with them
            write_groups(folder / Path(CARRIED_FILE).name, rollout_id, carried)
        for pending_id, output in pending.items():
            write_output(folder / f"pending_{pending_id:06d}.json", pending_id, output)

    savers = {name: saver(stack) for name, stack in stacks.training().items()}
    if carried or pending:
        savers[PENDING_FOLDER] = save_rollouts
    return savers


# --------------------------------------------------------------------------------------------
# The resume stage


CARRIED_FILE = "rollout/carried.json"
"""Where a checkpoint keeps the groups carried to the next rollout (kept dynamic-sampling
surplus), when there are any."""
PENDING_FOLDER = "rollout"
"""Where a checkpoint keeps rollouts generated ahead of training (``pending_NNNNNN.json``)."""


@attrs.frozen
class ResumePoint:
    """Where a training run starts, read before any stack is built: its first rollout id (from 0,
    so also the number of rollouts done before it), the prompts already consumed, the checkpoint
    folder (``None`` for a fresh run) and what the run changes from the checkpoint's settings
    (each applied; a refused one raised instead)."""

    first: int
    consumed: int
    folder: Path | None = None
    changes: tuple[SettingChange, ...] = ()

    def describe(self) -> list[str]:
        """Lines for the log: where the run resumes and every changed setting."""
        if self.folder is None:
            return []
        lines = [f"resuming from {self.folder}: training goes on with rollout {self.first + 1}"]
        lines += [f"  changed on resume: {change}" for change in self.changes]
        return lines


def resume_point(plan: TrainPlan) -> ResumePoint:
    """Where the run starts, read from the checkpoint ``plan.load`` names before any stack is
    built; with ``--finetune``, rollout 0 (or ``--start-rollout-id``) and a fresh prompt stream.

    Raises :class:`~rlcore.errors.CheckpointError` naming the path when there is no checkpoint;
    :class:`~rlcore.errors.ConfigError` listing the settings the run changes that a resume cannot
    take (:func:`rlcore.config.resume.resume_changes`: a changed ``--lr`` without
    ``--override-opt-param-scheduler``, ...), or a learning-rate schedule that would be at 0 for
    rollouts still to train; :class:`PlanError` when the checkpoint leaves nothing to train: a
    training run that trains nothing is a mistaken ``--num-rollout`` more often than a wish to
    evaluate, which ``--num-rollout 0`` says plainly.
    """
    start = plan.start_rollout_id
    if plan.load is None:
        first = start or 0
        return ResumePoint(first, first * plan.rollout_batch_size)
    folder = find_checkpoint(plan.load)
    meta = read_meta(folder)
    if plan.finetune:
        first = start or 0
        consumed = first * plan.rollout_batch_size
    else:
        first = meta.rollout_id + 1 if start is None else start
        consumed = meta.consumed_prompts
    if first >= plan.num_rollout:
        raise PlanError(
            f"--load {plan.load}: the checkpoint {folder.name} is of rollout "
            f"{rollout_number(meta.rollout_id)}, so training would start at rollout {first + 1}, "
            f"but --num-rollout is {plan.num_rollout}: nothing is left to train. Raise "
            f"--num-rollout above {first} to train on, or evaluate the checkpoint with "
            f"--num-rollout 0 --load {plan.load}"
        )
    changes: tuple[SettingChange, ...] = ()
    if meta.settings and plan.settings:
        saved, now = saved_config(meta.settings), saved_config(plan.settings)
        changes = tuple(resume_changes(saved, now))
        if any(not change.applied for change in changes):
            raise refusal(list(changes), str(plan.load))
        _check_learning_rate(plan, saved, now, meta.rollout_id, first)
    return ResumePoint(first, consumed, folder, changes)


def _check_learning_rate(
    plan: TrainPlan, saved: RunConfig, now: RunConfig, saved_rollout: int, first: int
) -> None:
    """Refuse a resume whose learning-rate schedule has ended (decayed to a minimum of 0) before
    the rollouts still to train: it would train them at a learning rate of 0."""
    spec = plan.actor.load.scheduler
    config = saved if spec == "saved" else now
    schedule = plan.actor.optimizer.schedule if spec != "saved" else None
    decay, style, min_lr = config.lr_decay_steps, config.optim.lr_decay_style, config.optim.min_lr
    if schedule is not None:
        decay, style, min_lr = schedule.decay_steps, schedule.decay_style, schedule.min_lr
    step = 0 if spec == "fresh" else (saved_rollout + 1) * saved.steps_per_rollout
    last = step + (plan.num_rollout - first) * now.steps_per_rollout
    if style != "constant" and min_lr == 0 and last > decay:
        ended = max(step, decay)
        raise ConfigError(
            [
                ConfigProblem(
                    with_flag("optim.lr_decay_iters"),
                    f"the resumed schedule ({style}) decays to 0 at optimizer step {decay}, so "
                    f"steps {ended + 1}..{last} would train at a learning rate of 0",
                    "give --lr-decay-iters of at least "
                    f"{last} with {'--override-opt-param-scheduler' if spec == 'saved' else 'it'}"
                    ", or a --min-lr above 0",
                )
            ],
            f"--load {plan.load}",
        )


@attrs.frozen
class Resumed:
    """Where a training run starts: its first rollout id, the prompts already consumed, the
    groups carried into the next rollout to generate, and rollouts generated ahead of training
    (an off-policy schedule's, saved with the checkpoint) to train on first."""

    first: int
    consumed: int
    carried: tuple[Group, ...] = ()
    pending: Mapping[int, RolloutOutput] = attrs.field(factory=dict)
    loaded: Path | None = None
    """The checkpoint folder the run loaded (``--save-retain`` never removes it)."""


def resume(plan: TrainPlan, stacks: TrainStacks) -> Resumed:
    """The resume stage: load every training stack from ``plan.load`` (as each stack's
    :class:`~rlcore.specs.LoadSpec` says; the reference model keeps its initial weights; all must
    agree on the rollout id), log what changed, and say where the run starts. A ``--finetune``
    run takes only the weights: no carried groups, no rollouts generated ahead; a critic the
    checkpoint does not have (an actor trained without one) keeps its initial weights."""
    point = resume_point(plan)
    folder = point.folder
    if folder is None:
        return Resumed(point.first, point.consumed)
    meta = read_meta(folder)
    loaded = dict(stacks.training())
    if plan.finetune and "critic" in loaded and not (folder / "critic").is_dir():
        del loaded["critic"]
        log.info("--finetune: %s has no critic; the critic starts from its initial weights", folder)
    ids = {name: stack.load(folder / name) for name, stack in loaded.items()}
    if any(i != meta.rollout_id for i in ids.values()):
        raise CheckpointError(
            f"stacks in {folder} disagree on the rollout id: {ids} "
            f"(checkpoint says {meta.rollout_id}); the checkpoint is mixed from different saves"
        )
    for line in point.describe():
        log.info("%s", line)
    if plan.finetune:
        return Resumed(point.first, point.consumed, loaded=folder)
    return Resumed(
        point.first,
        point.consumed,
        read_carried(folder, meta.rollout_id),
        read_pending(folder),
        loaded=folder,
    )


def read_carried(folder: Path, rollout_id: int) -> tuple[Group, ...]:
    """The groups checkpoint ``folder`` (of rollout ``rollout_id``) carries into the next rollout
    to generate, if any."""
    path = folder / CARRIED_FILE
    return read_groups(path, rollout_id) if path.is_file() else ()


def read_pending(folder: Path) -> dict[int, RolloutOutput]:
    """The rollouts checkpoint ``folder`` holds that were generated ahead of training."""
    pending = {}
    for path in sorted((folder / PENDING_FOLDER).glob("pending_*.json")):
        rollout_id = int(path.stem.removeprefix("pending_"))
        pending[rollout_id] = read_output(path, rollout_id)
    return pending
