"""Checks before anything starts: output folders that cannot be written, model folders that are
missing files or hold an incomplete safetensors file."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from rlcore.checkpoint_files import CheckpointMeta, find_checkpoint
from rlcore.config.checkpoint import CheckpointConfig
from rlcore.errors import ConfigError, ConfigProblem
from rlcore.loop.checkpoints import write_checkpoint
from rlcore.loop.preflight import (
    check_model_folder,
    prepare_output_folders,
    remove_earlier_checkpoints,
    remove_folders,
    rewind_checkpoints,
    safetensors_problem,
    save_folder_problems,
)

WHERE = "model.hf_checkpoint (--hf-checkpoint)"


def _weights(path: Path) -> None:
    save_file(
        {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, dtype=np.float32)},
        str(path),
    )


def _model_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_text("{}")
    _weights(folder / "model.safetensors")
    return folder


def test_output_folders_are_created_and_probed(tmp_path: Path) -> None:
    created = prepare_output_folders(
        [("output_dir (--output-dir)", tmp_path / "a" / "b"), ("checkpoint.save", tmp_path / "c")]
    )
    assert created == [tmp_path / "a", tmp_path / "a" / "b", tmp_path / "c"]
    assert sorted(p.name for p in (tmp_path / "a" / "b").iterdir()) == []  # the probe is gone
    remove_folders(created)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_output_folders_are_refused_with_their_flags(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ConfigError) as info:
        prepare_output_folders(
            [
                ("output_dir (--output-dir)", tmp_path / "new" / "out"),
                ("checkpoint.save (--save)", a_file / "ckpt"),
                ("eval (--x)", a_file),
                # A virtual file system: cannot be written, not even by root.
                ("checkpoint.save (--save)", Path("/proc/rlcore-test/ckpt")),
            ]
        )
    problems = [str(p) for p in info.value.problems]
    assert problems[0].startswith(f"checkpoint.save (--save): cannot create {a_file / 'ckpt'}")
    assert problems[1].startswith(f"eval (--x): {a_file} exists and is not a folder")
    assert problems[2].startswith("checkpoint.save (--save): cannot create /proc/rlcore-test")
    assert len(problems) == 3
    # The folders it created for the good entry are removed again: nothing is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_complete_model_folder_passes_and_gives_its_config(tmp_path: Path) -> None:
    problems, config = check_model_folder(_model_folder(tmp_path / "m"), WHERE)
    assert problems == [] and config == {"model_type": "llama"}


def test_missing_and_empty_model_folders_say_what_is_missing(tmp_path: Path) -> None:
    (problem,), config = check_model_folder(tmp_path / "nope", WHERE)
    assert config == {}
    assert problem.path == WHERE and problem.message == f"{tmp_path / 'nope'} does not exist"
    assert "not downloaded" in problem.hint
    (tmp_path / "empty").mkdir()
    (problem,), _ = check_model_folder(tmp_path / "empty", WHERE)
    assert problem.message == (
        f"{tmp_path / 'empty'} has no config.json, weights (model.safetensors, or "
        "model.safetensors.index.json and shards) and tokenizer (tokenizer.json, tokenizer.model "
        "or vocab files)"
    )
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"x")
    (problem,), _ = check_model_folder(tmp_path / "empty", WHERE)
    assert "safe_serialization=True" in problem.hint


def test_sharded_weights_name_the_missing_or_truncated_shard(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (problem,), _ = check_model_folder(folder, WHERE)
    assert problem.message.startswith(f"cannot read {folder / 'model-00002-of-00002.safetensors'}")


def test_unreadable_config_json_is_named(tmp_path: Path) -> None:
    folder = _model_folder(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    (problem,), config = check_model_folder(folder, WHERE)
    assert config == {} and problem.message.startswith(f"{folder / 'config.json'} is unreadable")


@given(st.data())
def test_a_truncated_safetensors_file_is_incomplete_exactly_when_safetensors_refuses_it(
    data: st.DataObject,
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        _weights(path)
        full = path.read_bytes()
        keep = data.draw(st.integers(min_value=0, max_value=len(full)))
        path.write_bytes(full[:keep])
        problem = safetensors_problem(path)
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    f.get_tensor(name)
            loads = True
        except SafetensorError:
            loads = False
        assert (problem is None) == loads
        if problem is not None:
            assert str(path) in problem and ("incomplete" in problem or "corrupt" in problem)


def test_a_corrupt_header_is_named(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes((5).to_bytes(8, "little") + b"{nope" + b"\0" * 10)
    assert safetensors_problem(path) == (
        f"{path} is corrupt: its header is not valid JSON (Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1))"
    )


def _checks(
    save: Path,
    load: Path | None = None,
    *,
    finetune: bool = False,
    overwrite_save: bool = False,
    rewind_save: bool = False,
) -> list[ConfigProblem]:
    c = CheckpointConfig(
        save=save,
        load=load,
        finetune=finetune,
        overwrite_save=overwrite_save,
        rewind_save=rewind_save,
    )
    return save_folder_problems(c)


def test_a_save_folder_is_one_runs(tmp_path: Path) -> None:
    """A fresh run may not save among another run's checkpoints; a resumed one may; with
    --overwrite-save they go, but never the one --load names."""
    save = tmp_path / "ckpt"
    assert _checks(save) == []  # no folder yet
    for rollout in (0, 1):
        write_checkpoint(save, CheckpointMeta(rollout, 4, ("actor",)), {"actor": lambda f: None})
    (save / ".tmp-rollout_000003-42").mkdir()  # an interrupted save's debris is not a checkpoint
    [refusal] = _checks(save)
    assert "already holds 2 checkpoint(s) of another run (rollout_000001 .. rollout_000002)" in (
        refusal.message
    )
    assert _checks(save, save) == []  # a resume
    assert _checks(save, overwrite_save=True) == []
    [loaded] = _checks(save, save, finetune=True, overwrite_save=True)
    assert "would remove" in loaded.message and "rollout_000002" in loaded.message
    assert [p.name for p in remove_earlier_checkpoints(save)] == [
        "rollout_000001",
        "rollout_000002",
        "latest",
    ]
    assert [p.name for p in save.iterdir()] == [".tmp-rollout_000003-42"]
    assert _checks(save) == []


def test_a_resume_from_an_older_checkpoint_into_the_same_folder_rewinds_it_or_is_refused(
    tmp_path: Path,
) -> None:
    """Checkpoints of rollouts 2 and 4: resuming from 2 into the same folder would save over 4.
    Refused, naming both and the ways out; with --rewind-save the later ones move aside, kept,
    and 'latest' is 2. A checkpoint of another folder may not resume into one with checkpoints."""
    save, other = tmp_path / "ckpt", tmp_path / "other"
    for rollout_id in (1, 3):
        write_checkpoint(save, CheckpointMeta(rollout_id, 4, ("actor",)), {"actor": lambda f: None})
    write_checkpoint(other, CheckpointMeta(1, 4, ("actor",)), {"actor": lambda f: None})
    older = save / "rollout_000002"
    [refusal] = _checks(save, older)
    assert refusal.path == "checkpoint.save (--save)"
    assert refusal.message == (
        f"--load {older} resumes from rollout_000002 (rollout 2), but {save}'s latest checkpoint "
        f"is rollout_000004 (rollout 4): this run would save over rollout_000004 and mix two runs "
        f"in {save}"
    )
    assert refusal.hint == (
        "save into another folder (--save NEW), or add --rewind-save to move the checkpoints "
        f"after rollout 2 to {save / 'rewound'}/N/ and cut metrics.jsonl back to it (slime and "
        "verl have no such flag: they save over the later checkpoints)"
    )
    assert _checks(save, older, rewind_save=True) == []
    assert _checks(save, save / "rollout_000004") == _checks(save, save) == []  # its latest
    assert _checks(tmp_path / "new", older) == []  # another, empty, --save
    [foreign] = _checks(save, other, rewind_save=True)
    assert f"resumes from {other / 'rollout_000002'}, which is not in {save}" in foreign.message
    assert "--rewind-save rewinds" in foreign.hint

    assert rewind_checkpoints(save, older) == ([save / "rollout_000004"], save / "rewound" / "1")
    assert sorted(p.name for p in save.iterdir()) == ["latest", "rewound", "rollout_000002"]
    assert find_checkpoint(save) == older
    assert (save / "rewound" / "1" / "rollout_000004" / "rlcore.json").is_file()  # kept whole
    assert rewind_checkpoints(save, older) == ([], None)  # nothing past it any more
