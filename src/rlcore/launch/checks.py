"""The checks before anything starts that read the file system and the user's code: the model
folder (its files, every safetensors file complete, ``config.json`` buildable by the chosen
backend, asked of its kind), a distillation teacher's folder, checkpoint or server, ``--load``'s
checkpoint against its manifest, the output folders, and every ``--...-path`` function. A
problem is a :class:`~rlcore.errors.ConfigError` naming the flag, raised before Ray or any model
starts (:func:`rlcore.launch.prepare.prepare` runs them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlcore.backends import BackendKind, load_backend_kind
from rlcore.checkpoint_files import (
    find_checkpoint,
    find_checkpoint_of,
    newest_intact_checkpoint,
    read_meta,
    recorded_model_folder,
    verify_checkpoint,
)
from rlcore.config import OPDConfig, RunConfig, with_flag
from rlcore.engines import load_engine
from rlcore.errors import CheckpointError, ConfigError, ConfigProblem, RolloutError
from rlcore.loop.plan import Plan, TrainPlan
from rlcore.loop.preflight import (
    check_model_folder,
    prepare_output_folders,
    remove_folders,
    save_folder_problems,
)
from rlcore.protocols.engine import TeacherServer
from rlcore.rollout import load_rollout_function
from rlcore.rollout.multiturn import load_custom_generate_function, load_environment_factory
from rlcore.specs import EvalSpec, ServedTeacher

__all__ = [
    "TEACHER_HEALTH_TIMEOUT_S",
    "check_fault_tolerance",
    "check_parallel_layout",
    "check_user_functions",
    "preflight",
    "served_teacher",
]


def _model_problems(
    kind: BackendKind[Any], hf_config: dict[str, Any], path: Path, where: str
) -> list[ConfigProblem]:
    """What the backend (``kind``) cannot build in the ``config.json`` at ``path``, by its own
    check (which imports no framework)."""
    return [
        ConfigProblem(where, f"{path}: {p.path}: {p.message}", p.hint)
        for p in kind.model_problems(hf_config, str(path))
    ]


_TOKENIZER_FILE = "tokenizer.json"
TEACHER_HEALTH_TIMEOUT_S = 30.0
"""How long a run waits for ``--opd-teacher-url``'s ``/health`` before it refuses to start."""


def _teacher_problems(
    kind: BackendKind[Any],
    teacher: Path,
    student: Path,
    student_config: dict[str, Any],
    where: str,
    what: str = "",
) -> tuple[list[ConfigProblem], dict[str, Any]]:
    """The OPD teacher's model folder: a model the backend can build, whose token ids mean what
    the student's do (the same vocabulary size and, when both folders have one, the same
    ``tokenizer.json``): the teacher scores the student's token ids. ``what`` introduces the
    folder in each problem (a checkpoint's recorded one); returns its ``config.json`` too."""
    found, hf_config = check_model_folder(teacher, where)
    if what:
        found = [ConfigProblem(where, f"{what}: {p.message}", p.hint) for p in found]
    if found or not hf_config:
        return found, {}
    problems = _model_problems(kind, hf_config, teacher / "config.json", where)
    problems += _token_problems(teacher, hf_config, student, student_config, where)
    return problems, hf_config


def _token_problems(
    teacher: Path,
    hf_config: dict[str, Any],
    student: Path,
    student_config: dict[str, Any],
    where: str,
) -> list[ConfigProblem]:
    """Whether the teacher's token ids mean what the student's do: the same vocabulary size and,
    when both folders have one, the same ``tokenizer.json``."""
    problems: list[ConfigProblem] = []
    hint = "distill from a teacher with the student's tokenizer"
    vocab, student_vocab = hf_config.get("vocab_size"), student_config.get("vocab_size")
    if student_config and vocab != student_vocab:
        problems.append(
            ConfigProblem(
                where,
                f"the teacher's vocabulary has {vocab} tokens and the student's {student_vocab} "
                f"({student}): the teacher must score the student's token ids",
                hint,
            )
        )
    mine, theirs = teacher / _TOKENIZER_FILE, student / _TOKENIZER_FILE
    if mine.is_file() and theirs.is_file() and mine.read_bytes() != theirs.read_bytes():
        problems.append(
            ConfigProblem(
                where,
                f"{mine} differs from the student's {theirs}: the two models do not share a "
                "tokenizer, so the same token id means different text to them",
                hint,
            )
        )
    return problems


def served_teacher(config: RunConfig, the_plan: Plan, notes: list[str]) -> TeacherServer | None:
    """``--opd-type sglang``: the teacher's server, reached before Ray starts by the engine kind
    of that name (:attr:`~rlcore.engines.EngineKind.connect_teacher`). It must answer within
    :data:`TEACHER_HEALTH_TIMEOUT_S`; when it serves a folder this machine can read, that folder
    must have the student's vocabulary and tokenizer (else a note says the tokenizers were not
    compared). Its architecture may differ from the student's: the server runs it, not the
    backend. Raises :class:`ConfigError` naming ``--opd-teacher-url``."""
    opd = the_plan.opd if isinstance(the_plan, TrainPlan) else None
    if opd is None or not isinstance(opd.teacher, ServedTeacher):
        return None
    where, url = with_flag("opd.opd_teacher_url"), opd.teacher.url
    kind = load_engine(config.opd.opd_type)
    if kind.connect_teacher is None:
        raise ConfigError(
            [ConfigProblem(with_flag("opd.opd_type"), f"{kind.name} serves no teacher")]
        )
    try:
        teacher, folder = kind.connect_teacher(url, TEACHER_HEALTH_TIMEOUT_S)
    except RolloutError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    where,
                    f"the teacher's server does not answer: {str(exc).splitlines()[0]}",
                    "check the URL",
                )
            ]
        ) from exc
    student = config.model.hf_checkpoint
    if folder is None or student is None:
        notes.append(
            f"teacher: the server at {url} serves a model this machine cannot read, so its "
            "tokenizer was not compared with the student's; it must be the same"
        )
        return teacher
    found, teacher_config = check_model_folder(folder, where)
    student_config = check_model_folder(student, with_flag("model.hf_checkpoint"))[1]
    problems = found or _token_problems(folder, teacher_config, student, student_config, where)
    if problems:
        what = f"the server at {url} serves {folder}"
        raise ConfigError([ConfigProblem(where, f"{what}: {p.message}", p.hint) for p in problems])
    return teacher


def _teacher_checkpoint_problems(
    kind: BackendKind[Any], opd: OPDConfig, student: Path, student_config: dict[str, Any]
) -> list[ConfigProblem]:
    """``--opd-teacher-load`` (and ``--opd-teacher-ckpt-step``): a complete, intact checkpoint
    with an actor, whose run recorded a model folder that is still there, builds, shares the
    student's vocabulary and tokenizer, and has the shape of the weights saved in the checkpoint
    (``rollout.json``'s record): the teacher is built from that folder's ``config.json`` and
    given the checkpoint's weights."""
    load, step = opd.opd_teacher_load, opd.opd_teacher_ckpt_step
    assert load is not None
    where = with_flag("opd.opd_teacher_load")
    try:
        checkpoint = find_checkpoint_of(load, step)
    except CheckpointError as exc:
        # A save folder without that step: the step is what to change.
        picked = step is not None and load.is_dir() and not (load / "rlcore.json").is_file()
        hint = "pick one of them" if picked else "point it at a folder that --save wrote"
        flag = with_flag("opd.opd_teacher_ckpt_step") if picked else where
        return [ConfigProblem(flag, str(exc), hint)]
    try:
        if "actor" not in read_meta(checkpoint).stacks:
            raise CheckpointError(f"{checkpoint} holds no actor, so no teacher's weights")
        folder = recorded_model_folder(checkpoint)
    except CheckpointError as exc:
        return [ConfigProblem(where, str(exc), "distill from a checkpoint of an rlcore run")]
    problems = _damaged(checkpoint, "opd.opd_teacher_load", "--opd-teacher-load")
    what = f"{checkpoint} was trained from the model folder {folder}, the teacher's architecture"
    found, hf_config = _teacher_problems(kind, folder, student, student_config, where, what)
    problems += found
    if hf_config and not found:
        config_json = str(folder / "config.json")
        mismatch = kind.saved_model_problem(checkpoint / "actor", hf_config, config_json)
        if mismatch is not None:
            problems.append(
                ConfigProblem(
                    where,
                    mismatch,
                    "the teacher's weights must fit the model folder its run recorded: restore "
                    "that folder, or distill from another checkpoint",
                )
            )
    return problems


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
    kind = load_backend_kind(config.model.train_backend)  # the config check found it
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
            found = _model_problems(kind, hf_config, folder / "config.json", where)
            problems += found
            if not found and kind.options_model_problems is not None:
                options = kind.options(config.model.backend_options)
                problems += kind.options_model_problems(options, hf_config)
        o = config.opd
        if o.use_opd and not config.is_eval_only and not config.debug.debug_rollout_only:
            if o.opd_teacher_hf_checkpoint is not None:
                where = with_flag("opd.opd_teacher_hf_checkpoint")
                problems += _teacher_problems(
                    kind, o.opd_teacher_hf_checkpoint, folder, hf_config, where
                )[0]
            elif o.opd_teacher_load is not None:
                problems += _teacher_checkpoint_problems(kind, o, folder, hf_config)
    if config.checkpoint.load is not None:
        try:
            problems += _damaged(
                find_checkpoint(config.checkpoint.load), "checkpoint.load", "--load"
            )
        except CheckpointError as exc:
            problems.append(ConfigProblem(with_flag("checkpoint.load"), str(exc)))
    outputs = [(with_flag("output_dir"), config.output_dir)]
    c = config.checkpoint
    if c.save is not None:
        outputs.append((with_flag("checkpoint.save"), c.save))
        problems += save_folder_problems(c)
    created: list[Path] = []
    try:
        created = prepare_output_folders(outputs)
    except ConfigError as exc:
        problems += exc.problems
    if problems:
        remove_folders(created)
        raise ConfigError(problems)
    return created


def _damaged(checkpoint: Path, path: str, flag: str) -> list[ConfigProblem]:
    """The checkpoint the setting at ``path`` (``--load``, ``--opd-teacher-load``: ``flag``)
    names against its manifest, with the newest intact one beside it to load instead."""
    found = verify_checkpoint(checkpoint)
    if not found:
        return []
    intact = newest_intact_checkpoint(checkpoint.parent, besides=checkpoint)
    hint = (
        f"load the newest intact checkpoint instead: {flag} {intact}"
        if intact is not None
        else "no intact checkpoint is left beside it: start afresh"
    )
    message = f"checkpoint {checkpoint} is damaged: " + "; ".join(found)
    return [ConfigProblem(with_flag(path), message, hint)]


def check_user_functions(config: RunConfig) -> None:
    """Import every function a ``--...-path`` flag names, so that a bad path stops the run before
    Ray, the engine or any model starts (a :class:`ConfigError` naming the flag); the
    dynamic-sampling filter is the plan's (:func:`~rlcore.loop.rollouts.group_filter_of`)."""
    r, a = config.rollout, config.algorithm
    if r.rollout_function_path is not None:
        load_rollout_function(r.rollout_function_path)
    if config.multiturn.environment_path is not None:
        load_environment_factory(config.multiturn.environment_path)
    if config.multiturn.custom_generate_function_path is not None:
        load_custom_generate_function(config.multiturn.custom_generate_function_path)
    if config.corrects_off_policy and a.custom_tis_function_path is not None:
        from rlcore.algorithms.correction import load_is_weight_fn

        load_is_weight_fn(a.custom_tis_function_path)


def check_fault_tolerance(config: RunConfig) -> None:
    """``--use-fault-tolerance`` restarts servers the run launched: refused (a
    :class:`ConfigError`) for an engine that, as configured, runs none."""
    if not config.rollout.use_fault_tolerance:
        return
    kind = load_engine(config.rollout.engine)
    if kind.runs_servers(kind.options(config.rollout.engine_options)):
        return
    raise ConfigError(
        [
            ConfigProblem(
                with_flag("rollout.use_fault_tolerance"),
                f"the {kind.name} engine, as configured, runs no server that this run launches, "
                "so there is nothing to restart (the embedded engine runs in this process; "
                "servers given by --sglang-url are restarted by whoever runs them)",
                "drop --use-fault-tolerance, or let the run launch its SGLang servers "
                "(--rollout-engine sglang without --sglang-url)",
            )
        ]
    )


def check_parallel_layout(config: RunConfig, the_plan: Plan) -> None:
    """Every model the plan builds is split as the chosen backend can split it (its kind's
    :attr:`~rlcore.backends.BackendKind.parallel_problem`: a dimension it does not implement is
    refused here, before anything starts, with a :class:`ConfigError` naming the backend)."""
    kind = load_backend_kind(config.model.train_backend)
    match the_plan:
        case TrainPlan():
            specs = [the_plan.actor.model]
            specs += [s.model for s in (the_plan.critic, the_plan.reference) if s is not None]
            teacher = the_plan.opd.teacher if the_plan.opd is not None else None
            specs += [teacher.model] if isinstance(teacher, EvalSpec) else []
        case _:
            specs = [the_plan.actor.model]
    for spec in specs:
        problem = kind.parallel_problem(spec.parallel)
        if problem is not None:
            raise ConfigError(
                [
                    ConfigProblem(
                        with_flag("model.train_backend"),
                        f"the {spec.role}: {problem}",
                        "split the model as this backend can, or pick a backend that splits it so",
                    )
                ]
            )
