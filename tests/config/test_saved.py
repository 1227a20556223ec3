"""An eval-only run of a checkpoint takes its sampling and data settings from the checkpoint's run
unless a flag says otherwise, and says which it took."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.checkpoint_files import CheckpointMeta
from rlcore.config import load_config
from rlcore.config.convert import settings_data
from rlcore.errors import ConfigError
from rlcore.loop.checkpoints import write_checkpoint

TRAIN = [
    "--num-rollout", "3", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
    "--global-batch-size", "16", "--rollout-max-response-len", "5", "--rollout-top-p", "0.9",
    "--eval-temperature", "0.6", "--input-key", "question", "--label-key", "answer",
    "--rm-type", "math", "--max-turns", "3",
]  # fmt: skip


@pytest.fixture
def checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A save folder whose checkpoint records the settings of a run trained with TRAIN."""
    monkeypatch.chdir(tmp_path)
    Path("eval.jsonl").touch()
    (tmp_path / "model").mkdir()
    trained = load_config([*TRAIN, "--hf-checkpoint", str(tmp_path / "model")])
    meta = CheckpointMeta(2, 8, ("actor",), settings_data(trained))
    write_checkpoint(tmp_path / "ckpt", meta, {"actor": lambda folder: None})
    return tmp_path / "ckpt"


def test_eval_only_takes_the_checkpoints_settings_and_says_so(checkpoint: Path) -> None:
    report: list[str] = []
    config = load_config(
        ["--num-rollout", "0", "--load", str(checkpoint), "--eval-prompt-data", "x", "eval.jsonl"],
        report=report,
    )
    assert config.model.hf_checkpoint == checkpoint.parent / "model"
    assert config.rollout.max_response_len == 5 and config.rollout.top_p == 0.9
    assert config.eval.temperature == 0.6
    assert (config.data.input_key, config.data.label_key) == ("question", "answer")
    assert config.data.rm_type == "math" and config.multiturn.max_turns == 3
    where = f"eval-only run of {checkpoint / 'rollout_000003'}"
    assert (
        f"{where}: rollout.max_response_len (--rollout-max-response-len) = 5: from the checkpoint"
        in report
    )
    assert f"{where}: data.rm_type (--rm-type) = 'math': from the checkpoint" in report
    # Settings the checkpoint's run left at their defaults are taken too, silently.
    assert not any("top_k" in line for line in report)


def test_flags_override_the_checkpoint_and_are_named(checkpoint: Path) -> None:
    report: list[str] = []
    flags = ["--num-rollout", "0", "--load", str(checkpoint), "--eval-prompt-data", "x"]
    config = load_config(
        [*flags, "eval.jsonl", "--rollout-max-response-len", "9", "--eval-temperature", "0.6"],
        report=report,
    )
    assert config.rollout.max_response_len == 9 and config.eval.temperature == 0.6
    assert any(
        line.endswith(
            "rollout.max_response_len (--rollout-max-response-len) = 9: given, where the "
            "checkpoint's run had 5"
        )
        for line in report
    )
    assert not any("temperature" in line for line in report)  # given, and the same


def test_training_runs_and_plain_eval_runs_take_nothing(checkpoint: Path) -> None:
    resumed = load_config([*TRAIN[:8], "--load", str(checkpoint)])
    assert resumed.rollout.max_response_len == 16  # a resumed run's settings are its own
    plain = load_config(["--num-rollout", "0", "--eval-prompt-data", "x", "eval.jsonl"])
    assert plain.rollout.max_response_len == 16


def test_an_eval_only_load_without_a_checkpoint_names_the_flag(tmp_path: Path) -> None:
    (tmp_path / "eval.jsonl").touch()
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                "--num-rollout", "0", "--load", str(tmp_path / "nothing"),
                "--eval-prompt-data", "x", str(tmp_path / "eval.jsonl"),
            ]
        )  # fmt: skip
    assert info.value.paths == ("checkpoint.load (--load)",)
    assert "does not exist" in str(info.value)
