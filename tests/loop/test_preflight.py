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

from rlcore.checkpoint_files import CheckpointMeta
from rlcore.errors import ConfigError
from rlcore.loop.checkpoints import write_checkpoint
from rlcore.loop.preflight import (
    check_model_folder,
    prepare_output_folders,
    remove_earlier_checkpoints,
    remove_folders,
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
        "model.safetensors.index.json and shards), a tokenizer (tokenizer.json, tokenizer.model "
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


def test_a_save_folder_is_one_runs(tmp_path: Path) -> None:
    """A fresh run may not save among another run's checkpoints; a resumed one may; with
    --overwrite-save they go, but never the one --load names."""
    save = tmp_path / "ckpt"
    assert save_folder_problems(save, None, fresh=True, overwrite=False) == []  # no folder yet
    for rollout in (0, 1):
        write_checkpoint(save, CheckpointMeta(rollout, 4, ("actor",)), {"actor": lambda f: None})
    (save / ".tmp-rollout_000003-42").mkdir()  # an interrupted save's debris is not a checkpoint
    [refusal] = save_folder_problems(save, None, fresh=True, overwrite=False)
    assert "already holds 2 checkpoint(s) of another run (rollout_000001 .. rollout_000002)" in (
        refusal.message
    )
    assert save_folder_problems(save, save, fresh=False, overwrite=False) == []  # a resume
    assert save_folder_problems(save, None, fresh=True, overwrite=True) == []
    [loaded] = save_folder_problems(save, save, fresh=True, overwrite=True)  # --finetune
    assert "would remove" in loaded.message and "rollout_000002" in loaded.message
    assert [p.name for p in remove_earlier_checkpoints(save)] == [
        "rollout_000001",
        "rollout_000002",
        "latest",
    ]
    assert [p.name for p in save.iterdir()] == [".tmp-rollout_000003-42"]
    assert save_folder_problems(save, None, fresh=True, overwrite=False) == []
