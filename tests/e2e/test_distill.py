"""On-policy distillation through ``python -m rlcore_megatron.run`` on the CPU (real Ray, Megatron
and the embedded engine): a teacher read from an rlcore checkpoint (``--opd-teacher-load``,
``--opd-teacher-ckpt-step``) scores exactly as the same weights exported to Hugging Face, and pure
distillation (``--opd-only``) trains on prompts without any label or reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.config.flags import load_config
from rlcore.launch.cli import execute
from rlcore.loop.metrics import read_jsonl_metrics

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]


def _flags(demo: Path, out: Path, *extra: str) -> list[str]:
    return [
        *("--hf-checkpoint", str(demo / "model"), "--prompt-data", str(demo / "train.jsonl")),
        *("--input-key", "prompt", "--label-key", "answer", "--rollout-batch-size", "4"),
        *("--n-samples-per-prompt", "2", "--global-batch-size", "8", "--micro-batch-size", "4"),
        *("--rollout-max-response-len", "5", "--lr", "1e-3", "--seed", "7"),
        *("--output-dir", str(out), *extra),
    ]


@pytest.fixture(scope="module")
def teacher_run(demo: Path, tmp_path_factory: pytest.TempPathFactory, ray_cluster: None) -> Path:
    """A run that taught the demo model the task on its labels (eight supervised warm-start
    rollouts), saving a checkpoint (``ckpt/rollout_000008``) and a Hugging Face export of it
    (``hf/rollout_000008``): a teacher that knows more than the untrained student."""
    folder = tmp_path_factory.mktemp("teacher_run")
    warm = ("--num-rollout", "8", "--sft-warmup-rollouts", "8", "--lr", "1e-2")
    saves = ("--save", str(folder / "ckpt"), "--save-hf", str(folder / "hf"))
    execute(load_config(_flags(demo, folder / "out", *warm, *saves)))
    return folder


def _opd_rows(out: Path) -> list[dict[str, float]]:
    return [r for r in read_jsonl_metrics(out / "metrics.jsonl") if "opd/kl_mean" in r]


def test_a_teacher_from_a_checkpoint_scores_as_its_hugging_face_export(
    demo: Path, tmp_path: Path, teacher_run: Path
) -> None:
    """The checkpoint's weights reach the teacher: the student (the demo model, which is also the
    model folder the checkpoint's run recorded, so the teacher's architecture) is scored exactly
    as by the export of the same rollout, and far from 0 (which a teacher left with the recorded
    folder's own weights would give)."""
    ckpt = teacher_run / "ckpt"
    one = ("--num-rollout", "1", "--use-opd")
    loaded = tmp_path / "loaded"
    execute(
        load_config(
            _flags(demo, loaded, *one, "--opd-teacher-load", str(ckpt), "--opd-teacher-ckpt-step=8")
        )
    )
    exported = tmp_path / "exported"
    hf = teacher_run / "hf" / "rollout_000008"
    execute(load_config(_flags(demo, exported, *one, "--opd-teacher-hf-checkpoint", str(hf))))
    (a,), (b,) = _opd_rows(loaded), _opd_rows(exported)
    assert a["opd/kl_mean"] > 0.3, a
    assert a["opd/kl_mean"] == pytest.approx(b["opd/kl_mean"], abs=1e-5)
    assert a["opd/teacher_logprob_mean"] == pytest.approx(b["opd/teacher_logprob_mean"], abs=1e-5)
    log = (loaded / "run.log").read_text()
    assert f"teacher: the actor of {ckpt / 'rollout_000008'} (rollout 8)" in log


def test_pure_distillation_trains_on_prompts_without_labels(
    demo: Path, tmp_path: Path, teacher_run: Path
) -> None:
    """--opd-only: prompts with no label and no reward function, and the student moves toward
    the teacher: the reverse KL falls."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in (demo / "train.jsonl").read_text().splitlines()]
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in rows[:64]))
    teacher = ("--opd-teacher-load", str(teacher_run / "ckpt"))
    flags = _flags(demo, tmp_path / "out", "--num-rollout", "8", "--use-opd", "--opd-only")
    bigger = (
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "4",
        "--global-batch-size",
        "32",
    )
    execute(load_config([*flags, *teacher, *bigger, "--prompt-data", str(prompts), "--lr", "1e-2"]))
    rows = _opd_rows(tmp_path / "out")
    assert len(rows) == 8
    # Nothing was scored: no reward, no estimator's KL penalty; only the teacher's signal.
    assert all(r["rollout/reward"] == 0.0 and "rollout/kl_penalty" not in r for r in rows)
    kl = [r["opd/kl_mean"] for r in rows]
    assert sum(kl[-2:]) < 0.5 * sum(kl[:2]), kl
