"""Everything ``python -m rlcore_megatron.run`` checks before anything starts (:func:`prepare`).

Fail fast, leave nothing behind: :func:`preflight` checks the model folder (its files, every
safetensors file complete, ``config.json`` read by the Megatron backend's own validator), that
``--load`` names a checkpoint, that the output folders can be written and that a fresh run does
not save among another run's checkpoints; then the data is read and checked (a malformed file
stops the run with the file and line), the plan is made, every ``--...-path`` function imported,
a ``--load`` that leaves nothing to train refused, and the ranks placed on this machine. A problem
found here stops the run before Ray or any model starts (the CLI exits with 2), and the folders
the checks created are removed again.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rlcore.checkpoint_files import (
    find_checkpoint,
    find_checkpoint_of,
    newest_intact_checkpoint,
    read_meta,
    recorded_model_folder,
    verify_checkpoint,
)
from rlcore.config import OPDConfig, RunConfig, with_flag
from rlcore.config.algorithm import AlgorithmConfig
from rlcore.config.cluster import ClusterConfig
from rlcore.config.convert import converter
from rlcore.data import HFTokenizer, load_eval_sets, load_prompts
from rlcore.engines import load_engine
from rlcore.errors import CheckpointError, ConfigError, ConfigProblem, RolloutError
from rlcore.loop import RunData, check_inputs, resume_point
from rlcore.loop.plan import EvalPlan, Plan, TrainPlan, plan, resolve_num_rollout
from rlcore.loop.preflight import (
    check_model_folder,
    prepare_output_folders,
    remove_folders,
    save_folder_problems,
)
from rlcore.loop.rollouts import group_filter_of
from rlcore.protocols import RewardFn, TeacherServer
from rlcore.rollout import load_rollout_function
from rlcore.rollout.multiturn import (
    load_custom_generate_function,
    load_environment_factory,
    with_env_reward,
)
from rlcore.rollout.rewards import get_reward_fn
from rlcore.samples import Prompt
from rlcore.specs import EvalSpec, ServedTeacher
from rlcore_megatron.placement import (
    NodeResources,
    PlacementError,
    PlacementRequest,
    plan_layout,
)

__all__ = [
    "Prepared",
    "check_user_functions",
    "load_run_data",
    "load_tokenizer",
    "local_node",
    "placement_problem",
    "placement_request",
    "prompt_length_limit",
    "preflight",
    "prepare",
]


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


_TOKENIZER_FILE = "tokenizer.json"
TEACHER_HEALTH_TIMEOUT_S = 30.0
"""How long a run waits for ``--opd-teacher-url``'s ``/health`` before it refuses to start."""


def _teacher_problems(
    teacher: Path, student: Path, student_config: dict[str, Any], where: str, what: str = ""
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
    problems = _model_problems(hf_config, teacher / "config.json", where)
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
    """``--opd-type sglang``: the teacher's server, reached before Ray starts. It must answer
    ``/health`` within :data:`TEACHER_HEALTH_TIMEOUT_S`; when it serves a folder this machine can
    read, that folder must have the student's vocabulary and tokenizer (else a note says the
    tokenizers were not compared). Its architecture may differ from the student's: the server
    runs it, not the backend. Raises :class:`ConfigError` naming ``--opd-teacher-url``."""
    opd = the_plan.opd if isinstance(the_plan, TrainPlan) else None
    if opd is None or not isinstance(opd.teacher, ServedTeacher):
        return None
    from rlcore_sglang.options import EngineOptions
    from rlcore_sglang.teacher import SGLangTeacher

    where, url = with_flag("opd.opd_teacher_url"), opd.teacher.url
    try:
        teacher = SGLangTeacher.connect(
            url, EngineOptions(health_timeout_s=TEACHER_HEALTH_TIMEOUT_S)
        )
    except RolloutError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    where,
                    f"the teacher's server does not answer: {str(exc).splitlines()[0]}",
                    "start it first (python -m sglang.launch_server --model-path TEACHER ...) "
                    "and check the URL",
                )
            ]
        ) from exc
    folder = teacher.model_folder()
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
    opd: OPDConfig, student: Path, student_config: dict[str, Any]
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
    found, hf_config = _teacher_problems(folder, student, student_config, where, what)
    problems += found
    if hf_config and not found:
        problems += _shape_problems(checkpoint / "actor", folder, hf_config, where)
    return problems


def _shape_problems(
    actor: Path, folder: Path, hf_config: dict[str, Any], where: str
) -> list[ConfigProblem]:
    """The model a Megatron checkpoint's ``rollout.json`` records against the one ``folder``'s
    ``config.json`` builds (say the folder was since replaced by another model)."""
    from rlcore_megatron.arch import arch_from_hf_config, model_info

    record = actor / "rollout.json"
    try:
        saved = json.loads(record.read_text())["model"]
        if not isinstance(saved, dict):
            raise TypeError(f"model is of type {type(saved).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [ConfigProblem(where, f"{record} cannot be read: {exc}")]
    here = model_info(arch_from_hf_config(hf_config, str(folder / "config.json")), "teacher")
    wrong = sorted(k for k in here if saved.get(k) != here[k])
    if not wrong:
        return []
    return [
        ConfigProblem(
            where,
            f"{actor} holds weights of another shape than {folder / 'config.json'} describes: "
            + ", ".join(f"{k} is {saved.get(k)!r} there, {here[k]!r} in the folder" for k in wrong),
            "the teacher's weights must fit the model folder its run recorded: restore that "
            "folder, or distill from another checkpoint",
        )
    ]


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
        o = config.opd
        if o.use_opd and not config.is_eval_only and not config.debug.debug_rollout_only:
            if o.opd_teacher_hf_checkpoint is not None:
                where = with_flag("opd.opd_teacher_hf_checkpoint")
                problems += _teacher_problems(
                    o.opd_teacher_hf_checkpoint, folder, hf_config, where
                )[0]
            elif o.opd_teacher_load is not None:
                problems += _teacher_checkpoint_problems(o, folder, hf_config)
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


def load_tokenizer(config: RunConfig) -> HFTokenizer:
    """The model folder's tokenizer, from local files only (:meth:`HFTokenizer.from_folder`)."""
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
        return HFTokenizer.from_folder(folder)
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


def prompt_length_limit(config: RunConfig) -> int | None:
    """The longest prompt the run takes, in tokens: ``--rollout-max-prompt-len``, else the
    model's maximum positions (``config.json``) less ``--rollout-max-response-len``, so that a
    prompt and its answer fit; ``None`` when neither is known."""
    r = config.rollout
    if r.max_prompt_len is not None:
        return r.max_prompt_len
    folder = config.model.hf_checkpoint
    if folder is None or not (folder / "config.json").is_file():
        return None
    hf_config = json.loads((folder / "config.json").read_text())
    positions = hf_config.get("max_position_embeddings", hf_config.get("n_positions"))
    if not isinstance(positions, int):
        return None
    if positions <= r.max_response_len:
        raise ConfigError(
            [
                ConfigProblem(
                    with_flag("rollout.max_response_len"),
                    f"{r.max_response_len} new tokens leave no room for a prompt in the "
                    f"{positions} positions of {folder / 'config.json'}",
                    f"lower it below {positions}",
                )
            ]
        )
    return positions - r.max_response_len


def load_run_data(
    config: RunConfig, tokenizer: HFTokenizer, notes: list[str] | None = None
) -> RunData:
    """Every prompt the run needs, read and validated before anything heavy is built. Prompts
    longer than :func:`prompt_length_limit` are left out; ``notes`` receives a line per file
    that lost some (how many, and the first one's place)."""
    d = config.data
    limit = prompt_length_limit(config)
    dropped: list[str] = []

    def note(where: str, kept: int) -> None:
        if dropped and notes is not None:
            notes.append(
                f"data: left out {len(dropped)} of the {len(dropped) + kept} prompts in {where}: "
                f"longer than {limit} tokens (--rollout-max-prompt-len); the first, {dropped[0]}"
            )
        dropped.clear()

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
        # Pure distillation scores nothing: its prompts need no label (an eval set still does).
        reward_free = config.opd.use_opd and config.opd.opd_only
        train = load_prompts(
            d.prompt_data,
            tokenizer=tokenizer,
            input_key=d.input_key,
            label_key=None if reward_free and not config.debug.debug_rollout_only else d.label_key,
            apply_chat_template=d.apply_chat_template,
            max_prompt_len=limit,
            dropped=dropped,
        )
        note(str(d.prompt_data), len(train))
    eval_sets = load_eval_sets(
        [(e.name, e.path) for e in config.eval.prompt_data],
        tokenizer=tokenizer,
        input_key=d.input_key,
        label_key=d.label_key,
        apply_chat_template=d.apply_chat_template,
        max_prompt_len=limit,
        dropped=dropped,
    )
    kept = sum(len(e.prompts) for e in eval_sets)
    note("the eval sets " + ", ".join(str(e.path) for e in config.eval.prompt_data), kept)
    return RunData(train_prompts=train, eval_sets=eval_sets, seed=config.seed)


def placement_request(config: RunConfig, the_plan: Plan) -> PlacementRequest:
    """What the run needs placed: the planned stacks' ranks (an eval-only run: the actor's only)
    and, when the engine runs servers, the rollout GPUs."""
    k = config.cluster
    kind = load_engine(config.rollout.engine)
    servers = kind.runs_servers(kind.options(config.rollout.engine_options))
    critic = isinstance(the_plan, TrainPlan) and the_plan.critic is not None
    reference = isinstance(the_plan, TrainPlan) and the_plan.reference is not None
    opd = the_plan.opd if isinstance(the_plan, TrainPlan) else None
    teacher = opd is not None and isinstance(opd.teacher, EvalSpec)  # a served one is not ours
    overlaps = isinstance(the_plan, TrainPlan) and the_plan.max_staleness > 0
    return PlacementRequest(
        actor_ranks=k.actor_ranks,
        critic_ranks=k.critic_ranks if critic else 0,
        reference=reference,
        teacher=teacher,
        rollout_gpus=k.rollout_gpus if servers else 0,
        gpus_per_engine=k.rollout_num_gpus_per_engine,
        colocate=k.colocate,
        # An engine in this process that generates while the ranks train gets a CPU slot of its
        # own, on the local CPU instance (a joined cluster does not place this process).
        driver_engine=(
            overlaps and not servers and config.ray_address is None and local_node().gpus == 0
        ),
    )


def placement_problem(settings: Mapping[str, Any]) -> PlacementError | None:
    """Whether the training ranks that ``settings`` (:func:`~rlcore.config.flags.read_settings`)
    ask for cannot fit this machine, read from the cluster settings alone: when the config has
    other problems too, this is the one to say first (no other fix makes the run start). Only the
    actor's and the critic's ranks are counted, so a refusal here is never wrong; ``None`` when
    they fit, when the settings cannot be read, or when the run joins a cluster."""
    if settings.get("ray_address") is not None or _ray_started():
        return None
    try:
        cluster = converter.structure(settings.get("cluster", {}), ClusterConfig)
        algorithm = converter.structure(settings.get("algorithm", {}), AlgorithmConfig)
        request = PlacementRequest(
            actor_ranks=cluster.actor_ranks,
            critic_ranks=cluster.critic_ranks if algorithm.critic else 0,
        )
    except Exception:  # unreadable settings: the config's own error says what is wrong
        return None
    try:
        plan_layout(request, [local_node()])
    except PlacementError as exc:
        return exc
    return None


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


@attrs.frozen
class Prepared:
    """A run checked and ready to start (:func:`prepare`): nothing is started yet."""

    config: RunConfig
    plan: Plan
    tokenizer: HFTokenizer
    data: RunData
    reward_fn: RewardFn
    request: PlacementRequest
    notes: tuple[str, ...] = ()
    """What the checks decided that the run's log should say (prompts left out)."""
    teacher: TeacherServer | None = None
    """The distillation teacher's server (``--opd-type sglang``), reached already."""


def prepare(config: RunConfig) -> Prepared:
    """Everything a run checks before anything starts: the file system (:func:`preflight`), the
    data, the plan, the user's functions, ``--load`` and whether the ranks fit this machine.

    Raises the problem found (:class:`ConfigError`, :class:`PlanError`, :class:`DataError`,
    :class:`PlacementError`, ...) after removing the folders it created.
    """
    created = preflight(config)
    try:
        tokenizer = load_tokenizer(config)
        notes: list[str] = []
        data = load_run_data(config, tokenizer, notes)
        if not config.is_eval_only:
            config = resolve_num_rollout(config, len(data.train_prompts))
        the_plan = plan(config)
        reward_fn = with_env_reward(
            get_reward_fn(config.data.rm_type, config.data.custom_rm_path),
            config.multiturn.env_reward,
        )
        check_user_functions(config)
        if not isinstance(the_plan, EvalPlan):
            group_filter_of(the_plan)  # imported, and refused where it cannot keep a group
        check_inputs(the_plan, data)
        if isinstance(the_plan, TrainPlan):
            resume_point(the_plan)
        check_fault_tolerance(config)
        teacher = served_teacher(config, the_plan, notes)
        request = placement_request(config, the_plan)
        if config.ray_address is None and not _ray_started():
            # The local instance will hold exactly this machine: refuse a run that cannot fit
            # now, before Ray starts. (A joined cluster is checked as Ray reports it, in
            # reserve().)
            plan_layout(request, [local_node()])
    except BaseException:
        remove_folders(created)
        raise
    return Prepared(config, the_plan, tokenizer, data, reward_fn, request, tuple(notes), teacher)
