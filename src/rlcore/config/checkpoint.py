"""The ``[checkpoint]`` and ``[debug]`` sections: saving and resuming; saving and replaying
rollouts, and running one half of the loop (slime's debug flags); with their invariants
(:func:`checkpoint_problems`, :func:`debug_problems`).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from rlcore.checkpoint_files import template_problem
from rlcore.config.fields import flag_of, option, problem
from rlcore.errors import ConfigProblem

__all__ = ["CheckpointConfig", "DebugConfig", "checkpoint_problems", "debug_problems"]

_TEMPLATE_HINT = (
    "write DIR ({what} go to DIR/rollout_NNNNNN...) or a path with '{{rollout_id}}' (slime's "
    "template, str.format: the rollout's number; a literal brace is doubled)"
)


@attrs.frozen
class CheckpointConfig:
    """Saving and resuming."""

    save: Path | None = option(
        None,
        "--save",
        "checkpoint folder, one run's: a run that starts afresh (no --load) refuses a folder "
        "holding checkpoints, unless --overwrite-save",
    )
    overwrite_save: bool = option(
        False,
        "--overwrite-save",
        "a run that starts afresh removes the checkpoints already in --save (else it refuses "
        "the folder, so that two runs' checkpoints never mix)",
    )
    rewind_save: bool = option(
        False,
        "--rewind-save",
        "resume into --save from one of its older checkpoints (--load SAVE/rollout_N): the "
        "checkpoints after it move to SAVE/rewound/K/ (kept, never deleted), 'latest' points at "
        "it, and metrics.jsonl, TensorBoard and W&B go back to it; without it such a resume is "
        "refused (slime and verl have no such flag: they save over the later checkpoints)",
    )
    save_interval: int | None = option(
        None,
        "--save-interval",
        "save every N rollouts (and always after the last): DIR/rollout_N, rollout_2N, ..., "
        "each named by the count of rollouts done",
    )
    save_retain: int | None = option(
        None,
        "--save-retain",
        "keep only the newest N checkpoints in --save: older ones are removed once a new one is "
        "'latest' (never the one --load names); default: keep all (verl's "
        "max_actor_ckpt_to_keep)",
    )
    save_hf: str | None = option(
        None,
        "--save-hf",
        "also write the actor as a Hugging Face folder (safetensors, config.json, the model "
        "folder's tokenizer files) into DIR/rollout_NNNNNN, or PATH with '{rollout_id}' replaced "
        "by the rollout's number, the count done as checkpoints are named (slime's flag); at "
        "--save-hf-interval and after the last rollout",
    )
    save_hf_interval: int | None = option(
        None,
        "--save-hf-interval",
        "export every N rollouts with --save-hf (default: --save-interval; always after the last)",
    )
    max_restarts: int = option(
        0,
        "--max-restarts",
        "when a training rank's process dies, rebuild the run from the latest "
        "checkpoint in --save (or from its start when there is none yet), up to N times "
        "(TorchElastic's --max-restarts); 0: the run fails at once",
    )
    load: Path | None = option(
        None, "--load", "checkpoint folder (or one rollout_* inside it) to resume from"
    )
    start_rollout_id: int | None = option(
        None,
        "--start-rollout-id",
        "count N rollouts as done: the run trains rollouts N+1 .. --num-rollout (slime's id of "
        "the first rollout, from 0); default: the loaded checkpoint's rollout, else 0",
    )
    override_opt_param_scheduler: bool = option(
        False,
        "--override-opt-param-scheduler",
        "on resume, the learning-rate schedule and the optimizer's settings come from the flags, "
        "not the checkpoint (the schedule's step count continues), as Megatron's flag",
    )
    no_load_optim: bool = option(
        False,
        "--no-load-optim",
        "on resume, start the optimizer's state (Adam moments) afresh",
    )
    no_load_rng: bool = option(
        False,
        "--no-load-rng",
        "on resume, take the prompt order and sampling seed from --seed, not the checkpoint's",
    )
    finetune: bool = option(
        False,
        "--finetune",
        "load only the weights from --load and start at rollout 0: a new optimizer, schedule and "
        "prompt stream (a warm start, then RL)",
    )

    @property
    def resume_flags(self) -> tuple[str, ...]:
        """The resume flags that are on, by their flag names."""
        names = (
            "override_opt_param_scheduler",
            "no_load_optim",
            "no_load_rng",
            "finetune",
            "rewind_save",
        )
        return tuple(flag_of(CheckpointConfig, n) for n in names if getattr(self, n))


@attrs.frozen
class DebugConfig:
    """Saving and replaying rollouts, and running one half of the loop (slime's debug flags)."""

    save_debug_rollout_data: str | None = option(
        None,
        "--save-debug-rollout-data",
        "write each rollout's samples to PATH, '{rollout_id}' replaced by the rollout's number, "
        "the count done as checkpoints are named (without it, PATH is a folder of "
        "rollout_NNNNNN.json files)",
    )
    load_debug_rollout_data: str | None = option(
        None,
        "--load-debug-rollout-data",
        "train on rollouts saved by --save-debug-rollout-data (PATH as there: rollout N's file "
        "feeds rollout N); no rollout engine is built",
    )
    debug_rollout_only: bool = option(
        False,
        "--debug-rollout-only",
        "generate (and save) rollouts without building any training stack",
    )
    debug_train_only: bool = option(
        False,
        "--debug-train-only",
        "train only, on --load-debug-rollout-data: no rollout engine, no eval",
    )

    @property
    def replays(self) -> bool:
        """Whether training reads saved rollouts instead of generating (no engine)."""
        return self.load_debug_rollout_data is not None or self.debug_train_only


def checkpoint_problems(c: CheckpointConfig, num_rollout: int | None) -> list[ConfigProblem]:
    """Ranges, a save folder for a save interval, and a start that leaves rollouts to train."""
    problems: list[ConfigProblem] = []

    def add(name: str, message: str, hint: str = "") -> None:
        problems.append(problem(CheckpointConfig, "checkpoint", name, message, hint))

    if c.save_interval is not None and c.save_interval < 1:
        add("save_interval", f"must be >= 1, got {c.save_interval}")
    if c.start_rollout_id is not None and c.start_rollout_id < 0:
        add("start_rollout_id", f"must be >= 0, got {c.start_rollout_id}")
    if c.save_retain is not None and c.save_retain < 1:
        add("save_retain", f"must be >= 1, got {c.save_retain}", "leave it out to keep them all")
    if c.max_restarts < 0:
        add("max_restarts", f"must be >= 0, got {c.max_restarts}")
    elif c.max_restarts > 0 and num_rollout == 0:
        add(
            "max_restarts",
            "restarts resume training from a checkpoint; --num-rollout 0 trains nothing",
            "drop --max-restarts (run the evaluation again if a rank dies)",
        )
    elif c.max_restarts > 0 and c.save is None:
        add(
            "max_restarts",
            "restarts resume from the run's latest checkpoint, but there is no save folder",
            "add --save DIR, with --save-interval N to lose at most N rollouts to a restart",
        )
    if c.save_hf_interval is not None and c.save_hf_interval < 1:
        add("save_hf_interval", f"must be >= 1, got {c.save_hf_interval}")
    if c.save_hf_interval is not None and c.save_hf is None:
        add(
            "save_hf_interval",
            "is set but there is no Hugging Face export folder",
            "add --save-hf DIR",
        )
    if c.save_hf is not None and (wrong := template_problem(c.save_hf)) is not None:
        add("save_hf", wrong, _TEMPLATE_HINT.format(what="exports"))
    if c.save_interval is not None and c.save is None:
        add("save", "--save-interval is set but there is no save folder", "add --save DIR")
    if c.load is None:
        for flag in c.resume_flags:
            name = flag.removeprefix("--").replace("-", "_")
            add(name, "has no effect without --load", "add --load DIR, or drop it")
    elif c.finetune and len(c.resume_flags) > 1:
        others = ", ".join(f for f in c.resume_flags if f != "--finetune")
        add(
            "finetune",
            f"already starts the optimizer, the schedule and the prompt stream afresh: {others} "
            "would change nothing",
            f"drop {others}",
        )
    if c.rewind_save and c.save is None:
        add("rewind_save", "rewinds the save folder, but there is none", "add --save DIR")
    if c.start_rollout_id is not None and num_rollout is not None:
        if c.start_rollout_id >= num_rollout > 0:
            add(
                "start_rollout_id",
                f"{c.start_rollout_id} leaves nothing to train out of {num_rollout} rollouts",
                "lower --start-rollout-id or raise --num-rollout",
            )
    return problems


def debug_problems(
    d: DebugConfig,
    eval_interval: int | None,
    eval_only: bool,
    max_staleness: int = 0,
    max_restarts: int = 0,
) -> list[ConfigProblem]:
    """The debug flags: which combinations mean something (with the eval interval, and whether
    the run only evaluates)."""
    problems: list[ConfigProblem] = []

    def add(name: str, message: str, hint: str = "") -> None:
        problems.append(problem(DebugConfig, "debug", name, message, hint))

    for name in ("save_debug_rollout_data", "load_debug_rollout_data"):
        path = getattr(d, name)
        if path is not None and (wrong := template_problem(path)) is not None:
            add(name, wrong, _TEMPLATE_HINT.format(what="rollout files"))
    if d.debug_rollout_only and d.replays:
        add(
            "debug_rollout_only",
            "cannot be combined with --debug-train-only or --load-debug-rollout-data",
            "generate with --debug-rollout-only, replay in another run",
        )
    if d.debug_train_only and d.load_debug_rollout_data is None:
        add(
            "debug_train_only",
            "trains on saved rollouts, but --load-debug-rollout-data is not given",
            "add --load-debug-rollout-data PATH (written by --save-debug-rollout-data)",
        )
    if d.load_debug_rollout_data is not None and d.save_debug_rollout_data is not None:
        add(
            "save_debug_rollout_data",
            "a run that replays saved rollouts generates none to save",
            "drop --save-debug-rollout-data",
        )
    if (d.debug_rollout_only or d.replays) and eval_only:
        add(
            "debug_rollout_only" if d.debug_rollout_only else "load_debug_rollout_data",
            "--num-rollout 0 evaluates only; the debug flags need rollouts",
            "set --num-rollout N > 0",
        )
    if (d.replays or d.debug_rollout_only) and max_staleness > 0:
        add(
            "debug_rollout_only" if d.debug_rollout_only else "load_debug_rollout_data",
            f"--max-staleness {max_staleness} overlaps generation with training, but this run "
            "only " + ("generates" if d.debug_rollout_only else "replays saved rollouts"),
            "drop --max-staleness",
        )
    if d.debug_rollout_only and max_restarts > 0:
        add(
            "debug_rollout_only",
            f"--max-restarts {max_restarts} resumes training from a checkpoint, but this run only "
            "generates",
            "drop --max-restarts",
        )
    if d.replays and eval_interval is not None:
        add(
            "load_debug_rollout_data",
            "a replaying run builds no rollout engine, so it cannot evaluate (--eval-interval)",
            "drop --eval-interval",
        )
    return problems
