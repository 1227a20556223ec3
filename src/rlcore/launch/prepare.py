"""Everything a launch checks before anything starts (:func:`prepare`), and what it reads.

Fail fast, leave nothing behind: :func:`preflight` checks the model folder (its files, every
safetensors file complete, ``config.json`` read by the chosen backend's own check), that
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
from typing import Any

import attrs

from rlcore.backends import load_backend_kind
from rlcore.config import RunConfig, with_flag
from rlcore.config.algorithm import AlgorithmConfig
from rlcore.config.cluster import ClusterConfig
from rlcore.config.convert import converter
from rlcore.data.hf_tokenizer import HFTokenizer
from rlcore.data.prompts import load_eval_sets, load_prompts
from rlcore.engines import load_engine
from rlcore.errors import ConfigError, ConfigProblem
from rlcore.launch.checks import (
    check_fault_tolerance,
    check_parallel_layout,
    check_user_functions,
    preflight,
    served_teacher,
)
from rlcore.launch.placement import (
    NodeResources,
    PlacementError,
    PlacementRequest,
    plan_layout,
)
from rlcore.loop import RunData, check_inputs, resume_point
from rlcore.loop.plan import EvalPlan, Plan, TrainPlan, plan, resolve_num_rollout
from rlcore.loop.preflight import (
    remove_folders,
)
from rlcore.loop.rollouts import group_filter_of
from rlcore.protocols.engine import TeacherServer
from rlcore.protocols.rollout import RewardFn
from rlcore.rollout.multiturn import (
    with_env_reward,
)
from rlcore.rollout.rewards import get_reward_fn
from rlcore.samples import Prompt
from rlcore.specs import EvalSpec

__all__ = [
    "Prepared",
    "load_run_data",
    "load_tokenizer",
    "local_node",
    "placement_problem",
    "placement_request",
    "prompt_length_limit",
    "prepare",
]


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
    """What the run needs placed: the planned stacks' ranks (an eval-only run: the actor's only;
    not those of an eval stack that views a training stack's model and runs in its ranks,
    :attr:`~rlcore.backends.BackendKind.model_owner`) and, when the engine runs servers, the
    rollout GPUs."""
    k = config.cluster
    kind = load_engine(config.rollout.engine)
    servers = kind.runs_servers(kind.options(config.rollout.engine_options))
    backend = load_backend_kind(config.model.train_backend)

    def own_model(spec: EvalSpec | None) -> bool:
        options = config.model.backend_options
        return spec is not None and backend.owner_of(options, spec) is None

    critic = isinstance(the_plan, TrainPlan) and the_plan.critic is not None
    reference = isinstance(the_plan, TrainPlan) and own_model(the_plan.reference)
    opd = the_plan.opd if isinstance(the_plan, TrainPlan) else None
    # a served teacher is not ours
    teacher = opd is not None and isinstance(opd.teacher, EvalSpec) and own_model(opd.teacher)
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
        check_parallel_layout(config, the_plan)
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
