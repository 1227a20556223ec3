"""What a resumed run may change: its settings against the ones its checkpoint recorded.

A run resumed with ``--load`` compares its config with the checkpoint's run
(:attr:`~rlcore.checkpoint_files.CheckpointMeta.settings`) and says, for every setting that
changed, what happens to it (:func:`resume_changes`):

- **applied**: what the carried state does not depend on: intervals, the number of rollouts,
  eval sets, logging, placement, sampling, the loss's coefficients, data keys.
- **applied with a flag**, in the anchors' spelling and meaning:
  ``--override-opt-param-scheduler`` for the learning-rate schedule and the optimizer's
  settings (the checkpoint's scheduler would be restored over them: without the flag a changed
  ``--lr`` is refused, not ignored), ``--no-load-optim`` for what changes the optimizer state's
  shape (``--bf16``, ``--use-distributed-optimizer``), ``--no-load-rng`` for ``--seed`` (the
  prompt order), ``--finetune`` for all of these at once (weights only, start at rollout 0).
- **refused**: what the checkpoint's sharding holds (tensor and expert parallel sizes), and a
  critic the checkpoint does not have (unless ``--finetune``).

Rollouts per optimizer step count as the schedule's: a changed ``--global-batch-size`` or
``--n-samples-per-prompt`` changes what one step of the saved schedule means, and a longer
``--num-rollout`` changes a decaying schedule's length (its default ``--lr-decay-iters``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs

from rlcore.config.convert import VERL_DR_GRPO_MODE, structure_config, with_flag
from rlcore.config.kinds import CHOICES
from rlcore.config.run_config import RunConfig
from rlcore.errors import ConfigError, ConfigProblem

__all__ = ["SettingChange", "refusal", "resume_changes", "saved_config"]

_OVERRIDE = "--override-opt-param-scheduler"


@attrs.frozen
class SettingChange:
    """One setting a resumed run changes: where (field path and flag), what the checkpoint's run
    had and what this run has, whether it takes effect, and what happens or what to do."""

    path: str
    saved: object
    now: object
    applied: bool
    what: str

    def __str__(self) -> str:
        verdict = "applied" if self.applied else "refused"
        return f"{self.path}: {self.saved!r} -> {self.now!r}: {verdict}, {self.what}"


def saved_config(settings: Mapping[str, Any]) -> RunConfig:
    """The :class:`RunConfig` a checkpoint's ``settings`` describe (without the engine's own
    options), in today's names: a checkpoint written before #34 records the Dr. GRPO loss
    aggregation as ``seq-mean-token-sum-norm``, read as ``seq-mean-token-sum-budget`` (the same
    number; today that name is verl's and refused). Raises :class:`~rlcore.errors.ConfigError`
    when today's rules refuse them."""
    kinds = {name for choice in CHOICES for name in choice.registry}
    data = {k: v for k, v in settings.items() if k not in kinds}
    algorithm = data.get("algorithm")
    if isinstance(algorithm, Mapping) and algorithm.get("loss_agg_mode") == VERL_DR_GRPO_MODE:
        data["algorithm"] = {**algorithm, "loss_agg_mode": "seq-mean-token-sum-budget"}
    return structure_config(data, "the checkpoint's settings")


_OPTIONS_FIELDS = frozenset(choice.options_field for choice in CHOICES)


def _fields(config: RunConfig) -> Iterator[tuple[str, object]]:
    for field in attrs.fields(RunConfig):
        value = getattr(config, field.name)
        if attrs.has(type(value)):
            for inner in attrs.fields(type(value)):
                if inner.name not in _OPTIONS_FIELDS:
                    yield f"{field.name}.{inner.name}", getattr(value, inner.name)
        else:
            yield field.name, value


def resume_changes(saved: RunConfig, config: RunConfig) -> list[SettingChange]:
    """Every setting ``config`` changes from ``saved`` (the checkpoint's run), in field order,
    then the schedule's derived length and the critic (module docstring)."""
    c = config.checkpoint
    old = dict(_fields(saved))
    changes = []
    for path, now in _fields(config):
        if old[path] != now and not path.startswith("checkpoint."):
            applied, what = _verdict(path, c.finetune, config)
            changes.append(SettingChange(with_flag(path), old[path], now, applied, what))
    schedule_fields = {"optim", "train.global_batch_size", "rollout.n_samples_per_prompt"}
    if (
        saved.lr_decay_steps != config.lr_decay_steps
        and config.optim.lr_decay_style != "constant"
        and not any(ch.path.startswith(tuple(schedule_fields)) for ch in changes)
    ):
        applied = c.override_opt_param_scheduler or c.finetune
        changes.append(
            SettingChange(
                "the LR schedule's decay (--lr-decay-iters, by default every optimizer step of "
                "--num-rollout)",
                f"{saved.lr_decay_steps} steps",
                f"{config.lr_decay_steps} steps",
                applied,
                "the new length applies from the checkpoint's step"
                if applied
                else f"the checkpoint's scheduler would keep decaying over "
                f"{saved.lr_decay_steps} steps: add {_OVERRIDE} to decay over "
                f"{config.lr_decay_steps} from the checkpoint's step",
            )
        )
    if config.algorithm.critic and not saved.algorithm.critic and not c.finetune:
        changes.append(
            SettingChange(
                "the critic (--use-critic, --advantage-estimator ppo)",
                "none",
                "trained",
                False,
                "the checkpoint has no critic to resume: start from its weights with --finetune",
            )
        )
    return changes


def _verdict(path: str, finetune: bool, config: RunConfig) -> tuple[bool, str]:
    """(applied, what happens) for a changed setting at ``path``."""
    c = config.checkpoint
    if path in ("model.tensor_model_parallel_size", "model.expert_model_parallel_size"):
        return False, "the checkpoint is sharded for the old size: resume with it"
    if finetune:
        return True, "--finetune: only the weights are loaded"
    if path == "seed":
        if c.no_load_rng:
            return True, "--no-load-rng: the prompt order and sampling follow the new seed"
        return False, "the prompt stream follows the checkpoint's seed: add --no-load-rng"
    if path in ("model.bf16", "optim.use_distributed_optimizer"):
        if c.no_load_optim:
            return True, "--no-load-optim: the optimizer starts afresh in the new form"
        return False, "the optimizer state holds the old form: add --no-load-optim"
    if path == "optim.clip_grad":
        return True, "the clip applies from the next step"
    if path.startswith("optim.") or path in (
        "train.global_batch_size",
        "rollout.n_samples_per_prompt",
    ):
        if c.override_opt_param_scheduler:
            return True, f"{_OVERRIDE}: the schedule continues from the checkpoint's step"
        return False, (
            "the checkpoint's schedule and optimizer settings would be restored over it: "
            f"add {_OVERRIDE}"
        )
    return True, "it applies from the first resumed rollout"


def refusal(changes: list[SettingChange], load: str) -> ConfigError:
    """The error for the changes a resume refuses."""
    return ConfigError(
        [
            ConfigProblem(ch.path, f"{ch.saved!r} in the checkpoint, {ch.now!r} now", ch.what)
            for ch in changes
            if not ch.applied
        ],
        f"--load {load}",
    )
