"""The README's "Your own task" section as a script: its blocks marked ``<!-- checked: own task
-->`` (``bash`` blocks run with ``bash``, ``python`` ones as scripts) or ``<!-- checked: own
task as FILE -->`` (written to ``FILE``), in order, in one folder.

``tests/e2e/test_own_task.py`` runs them with fewer rollouts (:data:`SHORT`);
``tools/demo_curves.py --demo own-task`` runs the steps before training once and then the training
command as written, once per seed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final, Literal

import attrs

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r"<!-- checked: own task(?: as (?P<file>\S+))? -->")
TRAIN = "python -m rlcore_megatron.run --hf-checkpoint sort/model"
"""How the training step starts: the step that :func:`train_step` finds."""

SHORT: Final[Mapping[str, str]] = {
    "--num-rollout 160": "--num-rollout 4",
    "--sft-warmup-rollouts 60": "--sft-warmup-rollouts 2",
    "--eval-interval 20": "--eval-interval 2",
    "--save-interval 80": "--save-interval 2",
}
"""The training command's counts, shortened for CI: what each setting does is the same."""


@attrs.frozen
class Step:
    line: int  # of the opening fence, 1-based
    language: Literal["bash", "python"]
    code: str
    file: str | None = None  # a block that is a file's contents, not a command


def steps(readme: Path = README) -> list[Step]:
    """The section's marked blocks, in order."""
    lines = readme.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        marker = MARKER.fullmatch(line.strip())
        if marker is None:
            continue
        fence = lines[i + 1].strip()
        language = fence.removeprefix("```")
        assert language in ("bash", "python"), f"README.md:{i + 2}: {fence!r} after {line!r}"
        end = lines.index("```", i + 2)
        code = "\n".join(lines[i + 2 : end]) + "\n"
        found.append(Step(i + 2, language, code, marker["file"]))  # type: ignore[arg-type]
    return found


def train_step(all_steps: Sequence[Step]) -> Step:
    """The step that trains (the one command that starts with :data:`TRAIN`)."""
    (train,) = [s for s in all_steps if s.code.startswith(TRAIN)]
    return train


def shortened(step: Step, replace: Mapping[str, str]) -> Step:
    """``step`` with each of ``replace``'s texts replaced, every one of which must be there."""
    code = step.code
    for old, new in replace.items():
        assert old in code, f"README.md:{step.line}: {old!r} is not in the command"
        code = code.replace(old, new)
    return attrs.evolve(step, code=code)


def run(step: Step, folder: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run (or write) ``step`` in ``folder``, as a user does in a shell whose ``python`` is this
    interpreter; fails with the output when it fails."""
    if step.file is not None:
        (folder / step.file).write_text(step.code)
        return subprocess.CompletedProcess([], 0, "", "")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if step.language == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", step.code]
    else:
        argv = [sys.executable, "-c", step.code]
    done = subprocess.run(
        argv, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"README.md:{step.line}:\n{done.stdout}\n{done.stderr}"
    return done
