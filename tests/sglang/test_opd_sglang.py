"""On-policy distillation from a teacher served by SGLang (``--opd-type sglang``): the teacher's
log-probs of the student's tokens, asked of a real CPU server, are the ones transformers computes;
and a CLI run distils from a server it connects to, which scores each rollout as it is made."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore.engines.hosts import LocalProcessHost
from rlcore.launch.demo import prepare_demo
from rlcore.samples import Generation, Prompt, Sample
from rlcore_sglang.client import SGLangEngine
from rlcore_sglang.launcher import LaunchSettings, start_server
from rlcore_sglang.teacher import SGLangTeacher
from tests.sglang.conftest import STARTUP_TIMEOUT_S, Weights
from tests.sglang.reference import hf_model, score

pytestmark = pytest.mark.sglang


def _samples(vocab_size: int) -> list[Sample]:
    """Prompts and responses of several lengths (one response empty), random token ids."""
    rng = random.Random(7)
    samples = []
    for i, length in enumerate([1, 5, 12, 0, 3]):
        prompt = (1, *(rng.randrange(3, vocab_size) for _ in range(2 + i)))
        # The vocabulary's last token too (SGLang misreports its id, not its log-prob).
        response = tuple(rng.randrange(3, vocab_size) for _ in range(length))[:-1] + (
            (vocab_size - 1,) if length else ()
        )
        generation = Generation(response, (0.0,) * length, "", "length")
        samples.append(Sample(Prompt(index=i, text="", token_ids=prompt), generation, 0.0, 0))
    return samples


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_teacher_server_scores_the_students_tokens_as_transformers_does(
    dp_engine: SGLangEngine,
    tiny_model: Path,
    weights_b: Weights,
    vocab_size: int,
    temperature: float,
) -> None:
    """Each response token's log-prob given the prompt and the response before it, under
    ``softmax(logits / T)`` at the rollout's temperature (1: one prefill; 0.7: a one-token
    generation per position), from one server; in requests of two samples (the engine's
    options)."""
    dp_engine.update_weights(weights_b.items(), version=70)
    server = dp_engine.servers[0]
    teacher = SGLangTeacher.connect(server.url, dp_engine.options)
    assert teacher.model_folder() == tiny_model  # the folder the server started from
    samples = _samples(vocab_size)
    scores = teacher.score(samples, temperature)
    model = hf_model(str(tiny_model), weights_b)
    for sample, got in zip(samples, scores, strict=True):
        prompt, response = sample.prompt.token_ids, sample.response.token_ids
        assert len(got) == len(response)
        assert got == pytest.approx(score(model, prompt, response, temperature), abs=2e-4)
        if temperature != 1.0 and response:
            assert got != pytest.approx(score(model, prompt, response), abs=1e-3)
    assert scores[3] == ()


def test_a_run_distils_from_a_teacher_server(tmp_path: Path) -> None:
    """``--use-opd --opd-type sglang --opd-teacher-url``: the run reaches the server before it
    starts, builds no teacher of its own, and the server scores every rollout; the teacher is
    the student's starting model, so the first rollout's reverse KL is 0."""
    demo = tmp_path / "demo"
    prepare_demo(demo)
    settings = LaunchSettings(
        model_path=demo / "model",
        startup_timeout_s=STARTUP_TIMEOUT_S,
        log_dir=tmp_path / "teacher-logs",
        env={"OMP_NUM_THREADS": "1"},
    )
    server = start_server(settings, LocalProcessHost())
    try:
        server.wait_until_healthy(settings.startup_timeout_s)
        # fmt: off
        run = subprocess.run(
            [
                sys.executable, "-m", "rlcore_megatron.run",
                "--hf-checkpoint", str(demo / "model"), "--input-key", "prompt",
                "--label-key", "answer", "--prompt-data", str(demo / "train.jsonl"),
                "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
                "--global-batch-size", "8", "--micro-batch-size", "8",
                "--rollout-max-response-len", "5", "--lr", "1e-3",
                "--use-opd", "--opd-type", "sglang", "--opd-teacher-url", server.url,
                "--opd-kl-coef", "0.5", "--output-dir", str(tmp_path / "out"),
            ],
            capture_output=True, text=True, timeout=1500, env=dict(os.environ),
        )
        # fmt: on
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["built"] == ["train:actor"] and summary["trained"] == [1, 2]
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    rows = [row for row in map(json.loads, lines) if "opd/kl_mean" in row]
    assert len(rows) == 2
    # fp32 on both sides: SGLang's prefill and Megatron's recomputation of the same weights.
    assert abs(rows[0]["opd/kl_mean"]) < 1e-4
    assert all(r["opd/teacher_logprob_mean"] < 0 and r["perf/teacher_s"] > 0 for r in rows)
    log = (tmp_path / "out" / "run.log").read_text()
    assert f"teacher: the server at {server.url} scores each rollout as it is made" in log
    assert "teacher: 1 rank(s)" not in log  # nothing placed for it
