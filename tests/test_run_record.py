"""What a restart (``--max-restarts``) goes on from: the run's own latest checkpoint, with none of
the resume flags a first ``--load`` needed, and a metrics file without the lost attempt's rows."""

from __future__ import annotations

import json
from pathlib import Path

from rlcore.checkpoint_files import CheckpointMeta
from rlcore.config import load_config
from rlcore.loop.checkpoints import write_checkpoint
from rlcore_megatron.run_record import restart_config, rewind_metrics


def test_a_restart_resumes_from_the_runs_own_latest_checkpoint(tmp_path: Path) -> None:
    flags = [
        *("--num-rollout", "8", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"),
        *("--global-batch-size", "4", "--micro-batch-size", "1", "--max-restarts", "2"),
        *("--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "warm"), "--finetune"),
    ]
    config = load_config(flags)
    # No checkpoint of its own yet: the run starts again as it was given.
    assert restart_config(config) == (config, None)

    write_checkpoint(tmp_path / "ckpt", CheckpointMeta(3, 8, ("actor",)), {"actor": lambda p: None})
    restarted, through = restart_config(config)
    assert through == 4  # rollout id 3 is rollout 4, the step its metrics row has
    c = restarted.checkpoint
    assert (c.load, c.save, c.finetune, c.start_rollout_id) == (
        tmp_path / "ckpt",
        tmp_path / "ckpt",
        False,  # --finetune again would start over at rollout 1 with fresh optimizer state
        None,
    )
    assert c.max_restarts == 2 and restarted.rollout == config.rollout


def test_rewinding_drops_the_rows_after_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "x": float(s)} for s in (0, 1, 2, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert rewind_metrics(path, through=2) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 2]
    assert rewind_metrics(path, through=2) == 0
    assert rewind_metrics(tmp_path / "none.jsonl", through=0) == 0
