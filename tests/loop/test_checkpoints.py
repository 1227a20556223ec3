"""Atomic checkpoints: a failed save never replaces a good one."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from rlcore.checkpoint_files import (
    MANIFEST_FILE,
    CheckpointMeta,
    complete_checkpoints,
    find_checkpoint,
    find_checkpoint_of,
    newest_intact_checkpoint,
    read_meta,
    verify_checkpoint,
)
from rlcore.errors import CheckpointError
from rlcore.loop.checkpoints import write_checkpoint
from tests.small_disk import SmallDisk


def _writer(text: str) -> Callable[[Path], None]:
    def save(folder: Path) -> None:
        assert folder.is_dir() and not any(folder.iterdir())  # made for the stack, empty
        (folder / "weights").write_text(text)

    return save


def test_save_then_find_latest(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, CheckpointMeta(0, 4, ("actor",)), {"actor": _writer("a0")})
    final = write_checkpoint(tmp_path, CheckpointMeta(1, 8, ("actor",)), {"actor": _writer("a1")})
    assert find_checkpoint(tmp_path) == final
    assert read_meta(final) == CheckpointMeta(1, 8, ("actor",))
    assert find_checkpoint(final) == final
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_checkpoint_is_named_by_its_rollouts_number_and_known_by_its_record(
    tmp_path: Path,
) -> None:
    """After 80 rollouts (rollout id 79) the folder is rollout_000080. A folder named by the id,
    as before rollouts were numbered by count, is still found by the number it records."""
    final = write_checkpoint(tmp_path, CheckpointMeta(79, 4, ("actor",)), {"actor": _writer("a")})
    assert final == tmp_path / "rollout_000080"
    old = final.rename(tmp_path / "rollout_000079")
    (tmp_path / "latest").write_text("rollout_000079\n")
    assert find_checkpoint(tmp_path) == old and read_meta(old).rollout_id == 79
    assert complete_checkpoints(tmp_path) == {old: 80}
    assert find_checkpoint_of(tmp_path, 80) == old
    with pytest.raises(CheckpointError, match="no checkpoint of rollout 79: it holds checkpoints "):
        find_checkpoint_of(tmp_path, 79)


def test_a_failed_save_leaves_the_previous_checkpoint_as_latest(tmp_path: Path) -> None:
    good = write_checkpoint(tmp_path, CheckpointMeta(0, 4, ("actor",)), {"actor": _writer("good")})

    def crash(folder: Path) -> None:
        (folder / "weights").write_text("half")
        raise OSError("disk full")

    with pytest.raises(CheckpointError, match="rollout_000002.*disk full"):
        write_checkpoint(
            tmp_path,
            CheckpointMeta(1, 8, ("actor", "critic")),
            {"actor": _writer("x"), "critic": crash},
        )
    assert find_checkpoint(tmp_path) == good
    assert (good / "actor" / "weights").read_text() == "good"
    assert not (tmp_path / "rollout_000002").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_resaving_a_rollout_replaces_it_whole(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, CheckpointMeta(3, 4, ("actor",)), {"actor": _writer("old")})
    final = write_checkpoint(tmp_path, CheckpointMeta(3, 4, ("actor",)), {"actor": _writer("new")})
    assert (final / "actor" / "weights").read_text() == "new"


def test_missing_and_corrupt_checkpoints_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        find_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        find_checkpoint(tmp_path)
    final = write_checkpoint(tmp_path, CheckpointMeta(0, 0, ("actor",)), {"actor": _writer("a")})
    (final / "rlcore.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="rlcore.json is corrupt"):
        read_meta(final)
    (tmp_path / "latest").write_text("rollout_000009\n")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        find_checkpoint(tmp_path)


def test_the_next_save_removes_what_an_interrupted_save_left_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_checkpoint(tmp_path, CheckpointMeta(0, 4, ("actor",)), {"actor": _writer("a0")})
    # What a save killed half-way leaves: its temporary folder (named after the dead process), the
    # old folder of a re-save and the temporary pointer.
    debris = [tmp_path / ".tmp-rollout_000001-4242", tmp_path / ".old-rollout_000000-4242"]
    for folder in debris:
        (folder / "actor").mkdir(parents=True)
        (folder / "actor" / "weights").write_text("half")
    (tmp_path / ".latest.tmp").write_text("rollout_000001\n")
    with caplog.at_level(logging.INFO, logger="rlcore"):
        final = write_checkpoint(
            tmp_path, CheckpointMeta(1, 8, ("actor",)), {"actor": _writer("a1")}
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "rollout_000001",
        "rollout_000002",
    ]
    assert find_checkpoint(tmp_path) == final
    logged = [r.getMessage() for r in caplog.records]
    for path in [*debris, tmp_path / ".latest.tmp"]:
        assert f"checkpoints: removed {path}, left behind by an interrupted save" in logged


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("same_rollout", [False, True], ids=["new", "re-save"])
def test_ctrl_c_during_a_save_leaves_no_debris_and_the_last_checkpoint(
    tmp_path: Path, stop: type[BaseException], same_rollout: bool
) -> None:
    """A save stopped by Ctrl-C (or SIGTERM's SystemExit) removes its temporary folder and goes
    on stopping; the previous checkpoint stays ``latest``, even one being replaced."""
    first = write_checkpoint(tmp_path, CheckpointMeta(0, 4, ("actor",)), {"actor": _writer("a0")})
    saved = sorted(p.name for p in tmp_path.iterdir())

    def interrupted(folder: Path) -> None:
        (folder / "weights").write_text("half")
        raise stop

    with pytest.raises(stop):
        write_checkpoint(
            tmp_path,
            CheckpointMeta(0 if same_rollout else 1, 8, ("actor",)),
            {"actor": interrupted},
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == saved
    assert find_checkpoint(tmp_path) == first
    assert (first / "actor" / "weights").read_text() == "a0"


def _bytes_writer(size: int) -> Callable[[Path], None]:
    def save(folder: Path) -> None:
        (folder / "weights").write_bytes(b"w" * size)

    return save


def test_a_save_that_cannot_fit_is_refused_before_it_writes(small_disk: SmallDisk) -> None:
    """The previous checkpoint's size against the free space, on a real 1 MiB disk."""
    disk = small_disk(2**20)
    first = write_checkpoint(
        disk, CheckpointMeta(0, 4, ("actor",)), {"actor": _bytes_writer(600_000)}
    )
    with pytest.raises(CheckpointError) as info:
        write_checkpoint(disk, CheckpointMeta(1, 8, ("actor",)), {"actor": _bytes_writer(600_000)})
    assert re.match(
        f"not enough space on the disk holding {re.escape(str(disk))} for checkpoint "
        r"rollout_000002: it needs about 586\.\d KiB \(the size of rollout_000001\) and "
        r"4\d\d\.\d KiB is free",
        str(info.value),
    ), str(info.value)
    assert f"free; the latest checkpoint is still {first}" in str(info.value)
    assert sorted(p.name for p in disk.iterdir()) == ["latest", "rollout_000001"]


@pytest.mark.parametrize("writer_error", ["ENOSPC", "its own words"])
def test_a_save_that_fills_the_disk_says_so_and_keeps_the_last_checkpoint(
    small_disk: SmallDisk, writer_error: str
) -> None:
    """The kernel's ENOSPC, or a writer that reports it in its own words (Megatron's
    ``CheckpointException ranks:...``): either way the message says the disk is full."""
    disk = small_disk(2**20)
    first = write_checkpoint(disk, CheckpointMeta(0, 4, ("actor",)), {"actor": _bytes_writer(1000)})

    def fill(folder: Path) -> None:
        try:
            _bytes_writer(2 * 2**20)(folder)
        except OSError:
            if writer_error == "ENOSPC":
                raise
            raise RuntimeError("CheckpointException ranks:dict_keys([0])") from None
        raise AssertionError("2 MiB fit on a 1 MiB disk")

    with pytest.raises(CheckpointError) as info:
        write_checkpoint(disk, CheckpointMeta(1, 8, ("actor",)), {"actor": fill})
    message = str(info.value)
    assert message.startswith(
        f"saving checkpoint {disk / 'rollout_000002'} failed: no space left on the device "
        f"holding {disk} ("
    )
    assert f"the latest checkpoint is still {first}" in message
    assert sorted(p.name for p in disk.iterdir()) == ["latest", "rollout_000001"]


def test_the_manifest_names_a_damaged_file_and_the_newest_intact_checkpoint(
    tmp_path: Path,
) -> None:
    saved = [
        write_checkpoint(
            tmp_path, CheckpointMeta(i, 4, ("actor",)), {"actor": _bytes_writer(3 * 2**20)}
        )
        for i in range(3)
    ]
    assert [verify_checkpoint(c) for c in saved] == [[], [], []]
    assert json.loads((saved[0] / MANIFEST_FILE).read_text())["files"].keys() == {"actor/weights"}
    last, middle = saved[2] / "actor" / "weights", saved[1] / "actor" / "weights"
    with last.open("r+b") as f:  # a shard cut in half
        f.truncate(3 * 2**19)
    assert verify_checkpoint(saved[2]) == [
        f"{last} has {3 * 2**19} bytes, {3 * 2**20} when it was saved"
    ]
    with middle.open("r+b") as f:  # the same size, other bytes at the end
        f.seek(3 * 2**20 - 1)
        f.write(b"x")
    assert verify_checkpoint(saved[1]) == [
        f"{middle} has changed since it was saved (its checksum differs)"
    ]
    assert newest_intact_checkpoint(tmp_path, besides=saved[2]) == saved[0]
    middle.unlink()
    assert verify_checkpoint(saved[1]) == [f"{middle} is missing"]


def test_save_retain_keeps_the_newest_and_the_loaded_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = write_checkpoint(tmp_path, CheckpointMeta(0, 4, ("actor",)), {"actor": _writer("a")})
    (tmp_path / "rollout_000009").mkdir()  # an incomplete folder is not a checkpoint: left alone
    with caplog.at_level(logging.INFO, logger="rlcore"):
        for rollout in (1, 2, 3):
            write_checkpoint(
                tmp_path,
                CheckpointMeta(rollout, 4, ("actor",)),
                {"actor": _writer("b")},
                retain=2,
                keep=loaded,
            )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "rollout_000001",  # the one the run loaded (rollout id 0: the first rollout)
        "rollout_000003",
        "rollout_000004",
        "rollout_000009",
    ]
    assert find_checkpoint(tmp_path) == tmp_path / "rollout_000004"
    assert f"checkpoints: removed {tmp_path / 'rollout_000002'} (--save-retain 2)" in [
        r.getMessage() for r in caplog.records
    ]
