"""Checks a run makes before anything heavy starts, so a bad path fails at once and not after an
hour of training.

- Output folders (``--save``, ``--output-dir``): :func:`prepare_output_folders` creates each one,
  writes a probe file into it and removes the probe. A folder that cannot be created or written
  (a read-only or virtual file system, a path that is a file) is refused with its flag, instead
  of failing at the first save and losing the work. The folders it had to create are returned,
  so a run that stops during its other checks can remove them again (:func:`remove_folders`).
- The save folder (``--save``) is one run's: :func:`save_folder_problems` refuses a run that
  starts afresh (no ``--load``, or ``--finetune``) into a folder holding checkpoints, unless
  ``--overwrite-save`` asks for them to go (:func:`remove_earlier_checkpoints`), and a resume
  from another checkpoint than the folder's latest, unless ``--rewind-save`` asks for the later
  ones to move aside (:func:`rewind_checkpoints`); two runs' checkpoints mixed under one
  ``latest`` cannot be told apart.
- A Hugging Face model folder (``--hf-checkpoint``): :func:`check_model_folder` says what is
  missing (``config.json``, weights, tokenizer), whether ``config.json`` is readable JSON, and
  whether every safetensors file is complete (:func:`safetensors_problem` reads only the header
  and the file size). Model hub names are not downloaded: the folder must exist locally.

Every check returns :class:`~rlcore.errors.ConfigProblem` s, so the caller reports all of them in
one :class:`~rlcore.errors.ConfigError`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlcore.checkpoint_files import (
    LATEST_FILE,
    complete_checkpoints,
    find_checkpoint,
    read_meta,
    rollout_number,
    saved_checkpoints,
)
from rlcore.config.checkpoint import CheckpointConfig
from rlcore.errors import CheckpointError, ConfigError, ConfigProblem

__all__ = [
    "check_model_folder",
    "first_free",
    "prepare_output_folders",
    "remove_earlier_checkpoints",
    "remove_folders",
    "rewind_checkpoints",
    "save_folder_problems",
    "safetensors_problem",
]

_PROBE = ".rlcore-write-probe"

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""Any one of these makes a tokenizer (fast, sentencepiece, BPE or WordPiece vocabularies)."""


# --------------------------------------------------------------------------------------------
# Output folders


def _probe(folder: Path, created: list[Path]) -> str | None:
    """Create ``folder`` (appending every folder made to ``created``), write and remove a probe
    file; what went wrong, or ``None``."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    for path in reversed(missing):  # outermost first, so each one made is recorded
        try:
            path.mkdir()
        except FileExistsError:
            if not path.is_dir():
                return f"{path} exists and is not a folder"
        except OSError as exc:
            return f"cannot create {path}: {exc.strerror or exc}"
        else:
            created.append(path)
    if not folder.is_dir():
        return f"{folder} exists and is not a folder"
    probe = folder / _PROBE
    try:
        probe.write_bytes(b"rlcore")
        probe.unlink()
    except OSError as exc:
        return f"cannot write into {folder}: {exc.strerror or exc}"
    return None


def prepare_output_folders(folders: Sequence[tuple[str, Path]]) -> list[Path]:
    """Make sure the run can write every folder ``(where, path)`` names (``where`` is the field
    and flag, e.g. ``"checkpoint.save (--save)"``); returns the folders it created, innermost
    last.

    Raises :class:`ConfigError` listing every folder that cannot be created or written, after
    removing the folders it created.
    """
    created: list[Path] = []
    problems = []
    for where, folder in folders:
        what = _probe(Path(folder), created)
        if what is not None:
            problems.append(ConfigProblem(where, what, "choose a folder this user can write"))
    if problems:
        remove_folders(created)
        raise ConfigError(problems)
    return created


def remove_folders(created: Sequence[Path]) -> None:
    """Remove folders :func:`prepare_output_folders` created, innermost first, when still empty
    (a run that stopped before writing anything leaves nothing behind)."""
    for folder in sorted(created, key=lambda p: len(p.parts), reverse=True):
        try:
            folder.rmdir()
        except OSError:
            pass  # not empty (something was written there after all) or already gone


def save_folder_problems(c: CheckpointConfig) -> list[ConfigProblem]:
    """Why a run may not save into ``--save`` (``c.save``):

    - it starts afresh (no ``--load``, or ``--finetune``) into a folder that holds checkpoints,
      without ``--overwrite-save``; or ``--overwrite-save`` would remove the checkpoint
      ``--load`` names;
    - it resumes from another checkpoint than the folder's latest (an older one of its own, or
      one elsewhere): its checkpoints would replace or mix with the ones there. An older one of
      its own is taken with ``--rewind-save``, which moves the later ones aside at start
      (:func:`rewind_checkpoints`)."""
    save = c.save
    earlier = [p for p in saved_checkpoints(save) if p.is_dir()] if save is not None else []
    if save is None or not earlier:
        return []
    where = "checkpoint.save (--save)"
    if c.load is not None and not c.finetune:
        return _resume_problems(save, c.load, rewind=c.rewind_save)
    if c.overwrite_save:
        loaded = _loaded(c.load)
        if loaded is not None and loaded.resolve().parent == save.resolve():
            return [
                ConfigProblem(
                    where,
                    f"--overwrite-save would remove {loaded}, the checkpoint --load names",
                    "save into a new folder",
                )
            ]
        return []
    resume = f"resume that run with --load {save} (without --finetune), " if c.load is None else ""
    return [
        ConfigProblem(
            where,
            f"{save} already holds {len(earlier)} checkpoint(s) of another run "
            f"({earlier[0].name} .. {earlier[-1].name}), and this run starts afresh: its "
            "checkpoints would mix with them under one 'latest'",
            f"{resume}save into a new folder, or add --overwrite-save to remove them",
        )
    ]


def _resume_problems(save: Path, load: Path, *, rewind: bool) -> list[ConfigProblem]:
    """A resume from ``load`` into the save folder ``save``, which holds checkpoints: refused
    unless it loads the folder's latest, or (``rewind``) an older one of the folder's own."""
    loaded = _loaded(load)
    try:
        latest = find_checkpoint(save)
    except CheckpointError:
        return []  # checkpoints without a 'latest': the save removes what an interrupted one left
    if loaded is None or loaded.resolve() == latest.resolve():
        return []
    where = "checkpoint.save (--save)"
    mine = loaded.resolve().parent == save.resolve()
    numbers = complete_checkpoints(save)
    later = [p.name for p, n in numbers.items() if n > _number(loaded) and p != loaded]
    if mine and rewind:
        return []
    if mine:
        return [
            ConfigProblem(
                where,
                f"--load {load} resumes from {loaded.name} (rollout {_number(loaded)}), but "
                f"{save}'s latest checkpoint is {latest.name} (rollout {_number(latest)}): this "
                f"run would save over {', '.join(later) or latest.name} and mix two runs in "
                f"{save}",
                f"save into another folder (--save NEW), or add --rewind-save to move the "
                f"checkpoints after rollout {_number(loaded)} to {save / 'rewound'}/N/ and cut "
                "metrics.jsonl back to it (slime and verl have no such flag: they save over "
                "the later checkpoints)",
            )
        ]
    return [
        ConfigProblem(
            where,
            f"--load {load} resumes from {loaded}, which is not in {save}, and {save} already "
            f"holds checkpoints up to {latest.name} (rollout {_number(latest)}): this run's "
            "checkpoints would mix with another run's there",
            f"save into another folder (--save NEW), or resume that run from its latest "
            f"(--load {save})"
            + (f"; --rewind-save rewinds {save} to a checkpoint of its own" if rewind else ""),
        )
    ]


def first_free(parent: Path) -> Path:
    """``parent/N`` for the first ``N`` from 1 that does not exist: where files set aside (not
    deleted) go, numbered in the order they went."""
    n = 1
    while (parent / str(n)).exists():
        n += 1
    return parent / str(n)


def _number(checkpoint: Path) -> int:
    return rollout_number(read_meta(checkpoint).rollout_id)


def rewind_checkpoints(save: Path, loaded: Path) -> tuple[list[Path], Path | None]:
    """``--rewind-save``: move the checkpoints of ``save`` after ``loaded`` (one of its own,
    older than its latest) into ``save/rewound/N/`` (the first free ``N``), and point ``latest``
    at ``loaded``; returns what moved (by their old paths) and where, never deleting anything."""
    after = _number(loaded)
    later = [p for p, n in complete_checkpoints(save).items() if n > after and p != loaded]
    if not later:
        return [], None
    folder = first_free(save / "rewound")
    folder.mkdir(parents=True)
    for path in later:
        path.rename(folder / path.name)
    pointer = save / f".{LATEST_FILE}.tmp"
    pointer.write_text(loaded.name + "\n")
    os.replace(pointer, save / LATEST_FILE)
    return later, folder


def _loaded(load: Path | None) -> Path | None:
    if load is None:
        return None
    try:
        return find_checkpoint(load)
    except CheckpointError:
        return None  # reported by the --load check


def remove_earlier_checkpoints(save: Path) -> list[Path]:
    """``--overwrite-save``: remove the checkpoints (and ``latest``) already in ``save``; returns
    what it removed."""
    removed = saved_checkpoints(save)
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return removed


# --------------------------------------------------------------------------------------------
# Model folders


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` cannot be loaded (missing, truncated, corrupt header), or
    ``None``. Reads the header only: 8 bytes of little-endian header length, a JSON header whose
    ``data_offsets`` say where each tensor ends, then the data, which must reach that far."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is incomplete: {size} bytes, not even a safetensors header"
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                return (
                    f"{path} is incomplete: its header alone needs {header_len + 8} bytes but "
                    f"the file has {size}"
                )
            header = json.loads(f.read(header_len))
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"
    except (ValueError, UnicodeDecodeError) as exc:
        return f"{path} is corrupt: its header is not valid JSON ({exc})"
    if not isinstance(header, dict):
        return f"{path} is corrupt: its header is not a JSON object"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return (
            f"{path} is incomplete: {size} bytes of the {expected} its header describes "
            "(an interrupted copy or download?)"
        )
    return None


def _weight_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The safetensors files of a model folder and the problems finding them."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: Mapping[str, str] = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return [], [f"{index} is not a valid safetensors index ({exc!r})"]
        return [folder / name for name in names], []
    if single.is_file():
        return [single], []
    return [], []


def check_model_folder(folder: Path, where: str) -> tuple[list[ConfigProblem], dict[str, Any]]:
    """Problems with the local Hugging Face model folder ``folder``, and its ``config.json`` as a
    mapping (empty when unreadable). ``where`` names the field and flag in the problems."""
    folder = Path(folder)
    local_hint = (
        "point it at a local Hugging Face model folder (config.json, model.safetensors, "
        "tokenizer files); model hub names are not downloaded"
    )
    if not folder.exists():
        return [ConfigProblem(where, f"{folder} does not exist", local_hint)], {}
    if not folder.is_dir():
        return [ConfigProblem(where, f"{folder} is a file, not a folder", local_hint)], {}
    problems: list[ConfigProblem] = []
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    files, weight_problems = _weight_files(folder)
    if not files and not weight_problems:
        missing.append("weights (model.safetensors, or model.safetensors.index.json and shards)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES) and not any(
        folder.glob("*.tiktoken")
    ):
        missing.append("tokenizer (tokenizer.json, tokenizer.model or vocab files)")
    if missing:
        hint = "save the model and its tokenizer there with save_pretrained(folder)"
        if (folder / "pytorch_model.bin").is_file() and not files:
            hint = "only pytorch_model.bin is there: re-save with safe_serialization=True"
        listed = " and ".join(
            [", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing
        )
        problems.append(ConfigProblem(where, f"{folder} has no {listed}", hint))
    problems += [ConfigProblem(where, p, "copy the files again") for p in weight_problems]
    for file in files:
        what = safetensors_problem(file)
        if what is not None:
            problems.append(ConfigProblem(where, what, "copy or download the file again"))
    config: dict[str, Any] = {}
    if (folder / "config.json").is_file():
        try:
            raw = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            problems.append(ConfigProblem(where, f"{folder / 'config.json'} is unreadable: {exc}"))
        else:
            if isinstance(raw, dict):
                config = raw
            else:
                problems.append(
                    ConfigProblem(where, f"{folder / 'config.json'} is not a JSON object")
                )
    return problems, config
