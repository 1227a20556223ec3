"""The export stage (``--save-hf``): the actor written as a Hugging Face folder that
``transformers`` and the rollout engines load, on ``--save-hf-interval`` (by default the save
interval) and after the last rollout.

The stack writes the weights and ``config.json`` (:class:`~rlcore.protocols.stacks.HFExporter`, in
the dtype it trains in); this stage adds the tokenizer's files from the actor's model folder, so
that each export is a whole model (``AutoTokenizer`` and ``AutoModelForCausalLM`` both load it). An
export is built in a hidden folder beside its destination and renamed into place
(:func:`~rlcore.loop.checkpoints.write_folder`): a failed or interrupted export leaves no folder
under its final name, and exporting the same rollout again replaces the folder only once the new
one is complete.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from rlcore.checkpoint_files import rollout_number, rollout_path
from rlcore.loop.checkpoints import write_folder
from rlcore.loop.plan import TrainPlan
from rlcore.loop.stages import should_save
from rlcore.protocols.stacks import HFExporter

__all__ = ["TOKENIZER_FILES", "export_hf", "hf_folder", "should_export_hf"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""The files of a model folder that are not weights or ``config.json`` and that an export
carries over: the tokenizer's, its chat template and the generation defaults."""

log = logging.getLogger("rlcore")


def hf_folder(where: str, rollout_id: int) -> Path:
    """The export folder after rollout id ``rollout_id``: ``where`` with ``{rollout_id}``
    replaced by the rollout's number when it has one (slime's template), else
    ``where/rollout_NNNNNN`` (:func:`~rlcore.checkpoint_files.rollout_path`)."""
    return rollout_path(where, rollout_id)


def should_export_hf(plan: TrainPlan, rollout_id: int) -> bool:
    """Export after rollout ``rollout_id``: every ``save_hf_interval``-th rollout and after the
    last one, when the plan exports at all."""
    return should_save(
        rollout_id, plan.num_rollout, plan.save_hf_interval, plan.save_hf is not None
    )


def export_hf(plan: TrainPlan, exporter: HFExporter, rollout_id: int) -> Path:
    """Write the actor after rollout ``rollout_id`` into its export folder (module docstring);
    returns the folder. Raises :class:`~rlcore.errors.CheckpointError` naming the folder when the
    export fails (saying so when the disk is full); earlier exports stay as they were."""
    assert plan.save_hf is not None  # the schedules export only when the plan says where
    final = hf_folder(plan.save_hf, rollout_id)
    final.parent.mkdir(parents=True, exist_ok=True)
    model_folder = plan.actor.model.hf_checkpoint

    def fill(folder: Path) -> None:
        exporter.save_hf(folder)
        if model_folder is None:
            return
        for name in TOKENIZER_FILES:
            if (model_folder / name).is_file():
                shutil.copy2(model_folder / name, folder / name)

    write_folder(
        final,
        fill,
        "the Hugging Face export",
        kept=lambda: "earlier exports are as they were",
        hint="Free some space or point --save-hf at a bigger disk",
    )
    if model_folder is None:
        log.warning("exported %s without tokenizer files: the actor has no model folder", final)
    else:
        log.info("exported the actor after rollout %d to %s", rollout_number(rollout_id), final)
    return final
