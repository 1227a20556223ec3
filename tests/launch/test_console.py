"""What a person watching a run sees: the progress bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import io
import logging
import re

import pytest
from rich.console import Console

from rlcore.launch.console import ProgressSink

LONG = {
    "rollout/reward": 0.03125,
    "train/actor/loss": 0.123456,
    "eval/heldout/reward": 0.42,
    "eval/a_much_longer_eval_set_name/reward": 0.5,
    "rollout/weight_version": 37.0,
}


@pytest.mark.parametrize("width", [60, 80, 200])
def test_the_bar_keeps_count_and_elapsed_time_on_a_narrow_terminal(width: int) -> None:
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=True, color_system=None)
    sink = ProgressSink(total=160, console=console)
    sink.log(37, LONG)  # the step is the rollout's number: the count done
    sink.close()
    last = out.getvalue().split("\r")[-1]
    line = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", last).strip()
    assert re.match(r"rollout +37/160 .* 0:00:\d\d ", line), line
    assert ("rollout/reward=0.031" if width >= 80 else "rollout/re") in line  # then cut to fit
    assert len(line) <= width


def test_without_a_terminal_one_plain_line_per_rollout_goes_to_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    console = Console(file=io.StringIO(), width=80)  # a file: not a terminal
    sink = ProgressSink(total=3, console=console)
    with caplog.at_level(logging.INFO, logger="rlcore"):
        for step in range(1, 4):
            sink.log(step, {"rollout/reward": (step - 1) / 4, "rollout/weight_version": step})
            sink.log(step, {"eval/heldout/reward": 0.5})  # not a rollout: no line of its own
    sink.close()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    for step, line in enumerate(lines, start=1):
        assert re.fullmatch(rf"rollout {step}/3  0:00:\d\d  .*", line), line
    assert lines[0].endswith("rollout/reward=0.000")
    assert lines[2].endswith("rollout/reward=0.500  eval/heldout/reward=0.500")
    assert console.file.getvalue() == ""  # type: ignore[attr-defined]  # no bar drawn


def test_long_runs_log_every_nth_rollout_and_the_last(caplog: pytest.LogCaptureFixture) -> None:
    sink = ProgressSink(total=250, console=Console(file=io.StringIO()))
    with caplog.at_level(logging.INFO, logger="rlcore"):
        for step in range(1, 251):
            sink.log(step, {"rollout/weight_version": float(step)})
    done = [int(r.getMessage().split()[1].split("/")[0]) for r in caplog.records]
    assert done == [*range(3, 250, 3), 250]


def test_the_train_steps_throughput_and_padding_come_last(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real tokens per second and the padding share of the actor's train step, then the padding
    share of the forward-only passes together (what a token budget changes), follow the scores,
    so a narrow terminal cuts them first; the passes' own shares stay in the metrics."""
    sink = ProgressSink(total=1, console=Console(file=io.StringIO(), width=80))
    with caplog.at_level(logging.INFO, logger="rlcore"):
        sink.log(
            1,
            {
                "perf/forward_padding": 0.4151,
                "perf/ref_logprobs_padding": 0.5,
                "perf/actor_train_padding": 0.0823,
                "perf/actor_train_tokens_per_sec": 12345.6,
                "rollout/reward": 0.25,
                "rollout/weight_version": 1.0,
            },
        )
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.endswith(
        "rollout/reward=0.250  train tokens/s=12346  padding=8%  forward padding=42%"
    ), line
