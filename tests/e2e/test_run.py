"""End to end on the CPU: `python -m rlcore_megatron.run` with real Ray, real Megatron, the embedded
engine and a tiny model built here. GRPO, save, resume, eval-only on the saved checkpoint, PPO
with a critic and a reference model, and bad data stopping the run before any model is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlcore.checkpoint_files import find_checkpoint, read_meta
from rlcore.config.flags import load_config
from rlcore.engines.embedded import EmbeddedEngine
from rlcore.launch.cli import execute, main
from rlcore.launch.pieces import make_engine
from rlcore.launch.prepare import load_tokenizer
from rlcore.loop.metrics import read_jsonl_metrics

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.megatron]


def _flags(demo: Path, out: Path, *extra: str, model: Path | None = None) -> list[str]:
    return [
        "--hf-checkpoint",
        str(model or demo / "model"),
        "--prompt-data",
        str(demo / "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "answer",
        "--eval-prompt-data",
        "heldout",
        str(demo / "eval.jsonl"),
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--rollout-max-response-len",
        "5",
        "--lr",
        "1e-3",
        "--output-dir",
        str(out),
        "--seed",
        "7",
        *extra,
    ]


def _summary(out: Path) -> dict[str, object]:
    summary: dict[str, object] = json.loads((out / "summary.json").read_text())
    return summary


def test_grpo_save_resume_then_eval_only(demo: Path, tmp_path: Path, ray_cluster: None) -> None:
    ckpt = tmp_path / "ckpt"
    first = execute(
        load_config(
            _flags(
                demo,
                tmp_path / "a",
                "--num-rollout",
                "3",
                "--save",
                str(ckpt),
                "--save-interval",
                "2",
                "--eval-interval",
                "2",
            )
        )
    )
    assert first.trained == (0, 1, 2) and first.saved == (1, 2)
    assert first.evaluated == (-1, 1, 2)
    assert first.built == ("train:actor",)
    rows = read_jsonl_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2, 3]  # numbers, from 1
    assert all(
        "train/actor/grad_norm" in r and r["train/actor/lr"] > 0
        for r in rows
        if "rollout/reward" in r
    )
    # The engine (HF) and the actor (Megatron) hold the same fp32 weights: their log-probs agree.
    assert all(r["train/actor/logprob_mismatch"] < 1e-3 for r in rows if "rollout/reward" in r)
    assert sum("eval/heldout/reward" in r for r in rows) == 3
    meta = read_meta(find_checkpoint(ckpt))
    assert (meta.rollout_id, meta.consumed_prompts, meta.stacks) == (2, 12, ("actor",))

    resumed = execute(
        load_config(
            _flags(
                demo, tmp_path / "b", "--num-rollout", "5", "--load", str(ckpt), "--save", str(ckpt)
            )
        )
    )
    assert resumed.trained == (3, 4)
    assert resumed.evaluated[0] == 2  # eval before training on a resumed run too
    assert read_meta(find_checkpoint(ckpt)).consumed_prompts == 20  # the data position carried on
    assert [
        r["step"]
        for r in read_jsonl_metrics(tmp_path / "b" / "metrics.jsonl")
        if "rollout/reward" in r
    ] == [4, 5]

    # Eval-only on the saved checkpoint, with critic and KL flags that it must not act on. The
    # model folder, the data keys and the response length come from the checkpoint's run.
    code = main(
        [
            "--num-rollout",
            "0",
            "--eval-interval",
            "1",
            "--load",
            str(ckpt),
            "--use-critic",
            "--use-kl-loss",
            "--eval-prompt-data",
            "heldout",
            str(demo / "eval.jsonl"),
            "--n-samples-per-eval-prompt",
            "2",
            "--eval-temperature",
            "1.0",
            "--output-dir",
            str(tmp_path / "c"),
        ]
    )
    assert code == 0
    summary = _summary(tmp_path / "c")
    assert summary["built"] == ["eval:actor"]  # no optimizer, scheduler, critic or reference
    assert summary["trained"] == [] and summary["evaluated"] == [5]  # after rollout 5
    rows = read_jsonl_metrics(tmp_path / "c" / "metrics.jsonl")
    assert {"eval/heldout/reward", "eval/heldout/pass@2"} <= set(rows[0])
    assert rows[0]["eval/heldout/response_len"] <= 5
    log = (tmp_path / "c" / "run.log").read_text()
    assert "not built: critic" in log and "not built: reference model" in log
    checkpoint = find_checkpoint(ckpt)
    for line in (
        f"model.hf_checkpoint (--hf-checkpoint) = {demo / 'model'}: from the checkpoint",
        "rollout.max_response_len (--rollout-max-response-len) = 5: from the checkpoint",
        "data.input_key (--input-key) = 'prompt': from the checkpoint",
        "eval.temperature (--eval-temperature) = 1.0: given, where the checkpoint's run had 0.0",
    ):
        assert f"eval-only run of {checkpoint}: {line}" in log, line


def _cli(*flags: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it: its own process, its own Ray start-up (this machine's CPUs)."""
    return subprocess.run(
        [sys.executable, "-m", "rlcore_megatron.run", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_ppo_with_critic_and_kl_on_this_machine(demo: Path, tmp_path: Path) -> None:
    """Actor, critic and reference model through the CLI's own Ray start-up: on a 2-core machine
    their ranks share one CPU slot and take turns (each used to claim a CPU of its own, and the
    run waited for a third CPU until the group timeout). Every pass is cut by a token budget
    (``--use-dynamic-batch-size``), and reports its padding."""
    run = _cli(
        *_flags(
            demo,
            tmp_path,
            "--num-rollout",
            "2",
            "--advantage-estimator",
            "ppo",
            "--kl-coef",
            "0.05",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.01",
            "--gamma",
            "1.0",
            "--lambd",
            "0.95",
            "--skip-eval-before-train",
            "--use-dynamic-batch-size",
            "--max-tokens-per-gpu",
            "48",
        )
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = _summary(tmp_path)
    assert summary["built"] == ["train:actor", "train:critic", "eval:reference"]
    assert summary["trained"] == [1, 2]
    rows = [r for r in read_jsonl_metrics(tmp_path / "metrics.jsonl") if "rollout/reward" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["train/critic/loss"] is not None and row["train/critic/loss"] >= 0
        assert "train/actor/kl_loss" in row and "rollout/kl_penalty" in row
        assert 0 <= row["perf/actor_train_padding"] < 1
        assert row["perf/ref_logprobs_tokens_per_sec"] > 0
        for name in ("ref_logprobs", "critic_values", "forward"):  # summed over the ranks
            assert 0 <= row[f"perf/{name}_padding"] < 1, name
    log = (tmp_path / "run.log").read_text()
    if (os.cpu_count() or 1) <= 2:
        assert "slot 0: " in log and "actor, reference, critic" in log


def test_more_ranks_than_the_machine_has_are_refused_at_once(demo: Path, tmp_path: Path) -> None:
    """A tensor-parallel run with one rank more than this machine has CPUs: refused before any
    rank starts, with what was asked and what there is (it used to wait for the group timeout)."""
    ranks = max(os.cpu_count() or 1, 2) + 1
    started = time.monotonic()
    run = _cli(
        *_flags(demo, tmp_path, "--num-rollout", "2"),
        "--tensor-model-parallel-size",
        str(ranks),
        "--actor-num-gpus-per-node",
        str(ranks),
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-3000:]  # found before anything started
    # Seconds of start-up (more on a loaded machine), not the 600 s group timeout of before.
    assert time.monotonic() - started < 240
    assert "PlacementError: the run does not fit on this Ray cluster" in run.stderr
    assert f"it needs {ranks} CPU slots and the cluster has room for {ranks - 1}" in run.stderr
    assert f"actor: {ranks} rank(s) on CPU slots 0-{ranks - 1}" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "summary.json").exists()


def test_bf16_grpo_then_eval_only(demo: Path, tmp_path: Path, ray_cluster: None) -> None:
    config = load_config(
        _flags(
            demo,
            tmp_path / "a",
            "--bf16",
            "--num-rollout",
            "2",
            "--save",
            str(tmp_path / "c"),
            "--save-hf",
            str(tmp_path / "hf"),
            "--skip-eval-before-train",
        )
    )
    engine = make_engine(config, load_tokenizer(config))
    assert isinstance(engine, EmbeddedEngine)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}  # the trainer's dtype
    engine.close()

    result = execute(config)
    assert result.trained == (0, 1) and result.built == ("train:actor",)
    rows = [
        r for r in read_jsonl_metrics(tmp_path / "a" / "metrics.jsonl") if "rollout/reward" in r
    ]
    # The engine samples with the bf16 weights the trainer holds (synced unconverted); their
    # log-probs differ by bf16 rounding in two implementations (measured: 6e-4; fp32: < 1e-6).
    assert len(rows) == 2 and all(r["train/actor/logprob_mismatch"] < 0.01 for r in rows)

    code = main(
        [
            "--bf16",
            "--num-rollout",
            "0",
            "--eval-interval",
            "1",
            "--load",
            str(tmp_path / "c"),
            "--hf-checkpoint",
            str(demo / "model"),
            "--input-key",
            "prompt",
            "--label-key",
            "answer",
            "--eval-prompt-data",
            "heldout",
            str(demo / "eval.jsonl"),
            "--output-dir",
            str(tmp_path / "e"),
        ]
    )
    assert code == 0
    assert _summary(tmp_path / "e")["built"] == ["eval:actor"]  # no mixed-precision optimizer

    # The Hugging Face export of the last rollout (written by rank 0 of the Ray group) is the
    # same model in bf16 with the tokenizer: evaluated from it, greedy answers are the same.
    export = tmp_path / "hf" / "rollout_000002"
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    assert (export / "tokenizer.json").read_bytes() == (
        demo / "model" / "tokenizer.json"
    ).read_bytes()
    code = main(
        _flags(
            demo,
            tmp_path / "f",
            "--bf16",
            "--num-rollout",
            "0",
            "--eval-interval",
            "1",
            model=export,
        )
    )
    assert code == 0
    from_checkpoint = read_jsonl_metrics(tmp_path / "e" / "metrics.jsonl")[0]
    from_export = read_jsonl_metrics(tmp_path / "f" / "metrics.jsonl")[0]
    for key in ("eval/heldout/reward", "eval/heldout/response_len"):
        assert from_export[key] == from_checkpoint[key], key


_RAY_HEAD = """
import sys, ray
ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes our stdin
ray.shutdown()  # stops the cluster this process started
"""


@pytest.fixture
def other_ray_cluster() -> Iterator[str]:
    """A Ray cluster started by another process (as ``ray start`` would), its GCS address."""
    head = subprocess.Popen(
        [sys.executable, "-c", _RAY_HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert head.stdin is not None and head.stdout is not None
    try:
        address = head.stdout.readline().strip()  # "" if the process died
        assert address, f"the Ray head process exited with {head.wait(timeout=60)}"
        yield address
    finally:
        head.stdin.close()
        try:
            head.wait(timeout=120)
        except subprocess.TimeoutExpired:
            head.kill()
            raise
        finally:
            head.stdout.close()  # unclosed, it surfaces as a ResourceWarning (an error here)


def test_joins_a_ray_cluster_and_logs_to_tensorboard_and_wandb(
    demo: Path, tmp_path: Path, other_ray_cluster: str
) -> None:
    out = tmp_path / "out"
    flags = _flags(
        demo,
        out,
        "--num-rollout",
        "2",
        "--skip-eval-before-train",
        "--ray-address",
        other_ray_cluster,
        "--use-tensorboard",
        "--use-wandb",
        "--advantage-estimator",
        "reinforce_plus_plus",
        "--normalize-advantages",
    )
    # No WANDB_API_KEY: wandb runs offline. The head enabled Ray's token authentication (its default
    # for a cluster ray.init starts, token in ~/.ray/auth_token); Ray sends that token to an
    # explicit address only when RAY_AUTH_MODE=token says so.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RAY_AUTH_"))}
    command = [sys.executable, "-m", "rlcore_megatron.run", *flags]
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 1
    assert f"--ray-address {other_ray_cluster}: could not join the Ray cluster" in refused.stderr
    assert "RAY_AUTH_MODE=token" in refused.stderr

    run = subprocess.run(
        command, capture_output=True, text=True, env={**env, "RAY_AUTH_MODE": "token"}, timeout=900
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"ray: joined the cluster at {other_ray_cluster}" in (out / "run.log").read_text()
    rewards = [
        r["rollout/reward"]
        for r in read_jsonl_metrics(out / "metrics.jsonl")
        if "rollout/reward" in r
    ]
    assert len(rewards) == 2

    # tensorboard ships no type information (no py.typed, no stubs)
    from tensorboard.backend.event_processing.event_accumulator import (  # type: ignore[import-untyped]
        EventAccumulator,
    )

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward")] == [
        (1, pytest.approx(rewards[0])),  # the rollouts' numbers, as in metrics.jsonl
        (2, pytest.approx(rewards[1])),
    ]

    # wandb's offline run: its record file holds the run's config and metric names (wandb 0.31
    # ships no Python reader for it; `wandb sync` uploads it later).
    (record,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    data = record.read_bytes()
    for name in (
        b"normalize_advantages",
        b"rollout/reward",
        b"train/actor/loss",
        b"train/actor/logprob_mismatch",
    ):
        assert name in data, name


def test_bad_data_stops_before_any_model_is_built(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "123>", "answer": "321"}\n{"prompt": "45\n')
    code = main(_flags(demo, tmp_path / "out", "--num-rollout", "2", "--prompt-data", str(bad)))
    assert code == 2  # found before anything started, as configuration problems are
    err = capsys.readouterr().err
    assert f"{bad}:2" in err
    assert not (tmp_path / "out" / "summary.json").exists()


def test_help_is_grouped() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlcore_megatron.run", "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    titles = [line for line in out.stdout.splitlines() if line and not line.startswith(" ")]
    # Each group's title names its TOML section, so a flag's place in a --config file is clear.
    for title in (
        "run (top level of the TOML file):",
        "rollout [rollout]:",
        "algorithm (advantages, loss, KL) [algorithm]:",
        "optimizer and LR schedule [optim]:",
        "checkpoints [checkpoint]:",
        "evaluation [eval]:",
        "debug (saving and replaying rollouts) [debug]:",
        "multi-turn and tools [multiturn]:",
    ):
        assert title in titles
    for flag in (
        "--num-rollout",
        "--sft-warmup-rollouts",
        "--rollout-function-path",
        "--over-sampling-batch-size",
        "--dynamic-sampling-filter-path",
        "--use-tis",
        "--tis-mode {clip,mask}",
        "--loss-agg-mode {seq-mean-token-mean,token-mean,seq-mean-token-sum-budget}",
        "--save-debug-rollout-data",
        "--debug-rollout-only",
        "--environment-path",
        "--custom-generate-function-path",
        "--max-turns",
        "--env-reward {ignore,replace,add}",
        "--bf16",
        "--use-distributed-optimizer",
    ):
        assert flag in out.stdout, flag
    # The usage is one line, not every flag again (the groups below describe them).
    usage = out.stdout.split("\n\n")[0]
    assert usage == "usage: python -m rlcore_megatron.run [--config FILE.toml] [--FLAG VALUE ...]"


def test_config_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--num-rollout", "0"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err


def test_dynamic_sampling_and_tis_then_a_replay_and_a_rollout_only_run(
    demo: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """The CLI with DAPO's dynamic sampling and TIS, its rollouts saved; a replay of them that
    builds no engine and retraces the run; a rollout-only run that builds no stack at all."""
    rollouts = tmp_path / "rollouts"
    out = tmp_path / "dapo"
    # Partial credit (bench-tiny's reward) gives the untrained demo model's groups some spread.
    reward = ["--custom-rm-path", "benchmarks.bench_tiny:prefix_partial"]
    algorithm = [*reward, "--use-tis", "--tis-clip-low", "0.5"]
    flags = _flags(
        demo,
        out,
        "--num-rollout",
        "2",
        "--skip-eval-before-train",
        "--over-sampling-batch-size",
        "6",
        "--dynamic-sampling-filter-path",
        "rlcore.rollout:check_reward_nonzero_std",
        "--over-sampling-surplus",
        "keep",
        "--save-debug-rollout-data",
        str(rollouts),
        *algorithm,
    )
    command = [sys.executable, "-m", "rlcore_megatron.run", *flags]
    root = Path(__file__).resolve().parents[2]  # benchmarks/ is importable from here
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in read_jsonl_metrics(out / "metrics.jsonl") if "rollout/reward" in r]
    assert len(rows) == 2
    for row in rows:
        generated, filtered = row["rollout/groups_generated"], row["rollout/groups_filtered"]
        assert row["rollout/groups_kept"] == generated - filtered
        assert row["rollout/sampling_rounds"] >= 1
        assert 0.5 <= row["train/actor/tis_weight"] <= 2.0
        assert row["train/actor/logprob_mismatch_max"] >= row["train/actor/logprob_mismatch"]
    assert sorted(p.name for p in rollouts.iterdir()) == [
        "rollout_000001.json",
        "rollout_000002.json",
    ]

    replay = tmp_path / "replay"
    replay_flags = _flags(demo, replay, "--num-rollout", "2", *algorithm)
    replay_flags += ["--load-debug-rollout-data", str(rollouts), "--debug-train-only"]
    assert main(replay_flags) == 0
    summary = _summary(replay)
    assert summary["trained"] == [1, 2] and summary["evaluated"] == []
    assert summary["built"] == ["train:actor"]
    assert "no rollout engine is used" in (replay / "run.log").read_text()
    again = [r for r in read_jsonl_metrics(replay / "metrics.jsonl") if "rollout/reward" in r]
    for original, replayed in zip(rows, again, strict=True):
        for key in ("rollout/reward", "train/actor/loss", "train/actor/grad_norm"):
            assert replayed[key] == original[key], key  # the same numbers, not just close

    saved_to = tmp_path / "generated"
    only = _flags(demo, tmp_path / "only", "--num-rollout", "1", "--debug-rollout-only")
    assert main([*only, "--save-debug-rollout-data", str(saved_to / "{rollout_id}.json")]) == 0
    summary = _summary(tmp_path / "only")
    assert summary["built"] == [] and summary["trained"] == [] and summary["rollouts"] == [1]
    assert (saved_to / "1.json").is_file()
    assert (
        "rollout-only run, not built: training stacks"
        in (tmp_path / "only" / "run.log").read_text()
    )


def test_a_bad_function_path_stops_the_run_before_anything_starts(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    flags = _flags(demo, out, "--num-rollout", "1")
    assert main([*flags, "--dynamic-sampling-filter-path", "no_such_module_xyz:keep"]) == 2
    err = capsys.readouterr().err
    assert "rollout.dynamic_sampling_filter_path (--dynamic-sampling-filter-path)" in err
    assert "cannot import module 'no_such_module_xyz'" in err
    assert not out.exists()  # stopped before Ray or a log: the folder it made is removed


def test_one_step_off_policy_through_the_cli_is_deterministic(
    demo: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """--max-staleness 1 with the embedded engine: rollout j + 1 generates with weights j while
    step j trains (the engine in this process on a CPU slot of its own), and two runs with the
    same seed log the same metrics."""
    rows = []
    for name in ("a", "b"):
        flags = _flags(demo, tmp_path / name, "--num-rollout", "4", "--max-staleness", "1")
        result = execute(load_config([*flags, "--eval-interval", "2"]))
        assert result.trained == (0, 1, 2, 3)
        metrics = read_jsonl_metrics(tmp_path / name / "metrics.jsonl")
        rows.append([{k: v for k, v in r.items() if not k.startswith("perf/")} for r in metrics])
    assert rows[0] == rows[1]
    trained = [r for r in rows[0] if "rollout/staleness_max" in r]
    assert [r["rollout/staleness_max"] for r in trained] == [0.0, 1.0, 1.0, 1.0]
    assert all("train/actor/tis_weight" in r for r in trained)  # the off-policy correction
    log = (tmp_path / "a" / "run.log").read_text()
    assert "slot 1: node" in log and "the driver's rollout engine" in log


def test_on_policy_distillation_from_a_teacher_in_the_actors_slots(
    demo: Path, tmp_path: Path, ray_cluster: None
) -> None:
    """--use-opd through the CLI's Ray backend: the teacher (here the student's own starting
    weights) is an eval stack in the actor's slots; the first rollout's reverse KL is 0."""
    flags = _flags(demo, tmp_path, "--num-rollout", "2", "--skip-eval-before-train")
    teacher = ["--use-opd", "--opd-teacher-hf-checkpoint", str(demo / "model")]
    result = execute(load_config([*flags, *teacher, "--opd-kl-coef", "0.5"]))
    assert result.built == ("train:actor", "eval:teacher")
    rows = [r for r in read_jsonl_metrics(tmp_path / "metrics.jsonl") if "opd/kl_mean" in r]
    assert len(rows) == 2 and abs(rows[0]["opd/kl_mean"]) < 1e-5
    assert rows[0]["opd/teacher_logprob_mean"] < 0 and rows[0]["perf/teacher_s"] > 0
    log = (tmp_path / "run.log").read_text()
    assert "teacher: 1 rank(s) on CPU slots 0" in log and "actor, teacher" in log


def test_a_resume_with_a_changed_lr_is_refused_then_applied_with_the_override(
    demo: Path, tmp_path: Path, ray_cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = str(tmp_path / "ckpt")
    assert main(_flags(demo, tmp_path / "a", "--num-rollout", "2", "--save", ckpt)) == 0
    resumed = _flags(demo, tmp_path / "b", "--num-rollout", "4", "--save", ckpt, "--load", ckpt)
    capsys.readouterr()
    assert main([*resumed, "--lr", "5e-4"]) == 2  # found before Ray or any model starts
    error = capsys.readouterr().err
    assert "optim.lr (--lr): 0.001 in the checkpoint, 0.0005 now" in error
    assert "add --override-opt-param-scheduler" in error
    assert not (tmp_path / "b").exists()
    assert main([*resumed, "--lr", "5e-4", "--override-opt-param-scheduler"]) == 0
    rows = read_jsonl_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["train/actor/lr"] for r in rows if "train/actor/lr" in r] == [5e-4, 5e-4]
    log = (tmp_path / "b" / "run.log").read_text()
    assert "changed on resume: optim.lr (--lr): 0.001 -> 0.0005: applied" in log
