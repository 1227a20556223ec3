"""The README's Python blocks are checked, so the README cannot drift from the API.

Every ```python block is preceded by a marker line saying how it is checked:

- ``<!-- checked: run -->``: it runs (in an empty folder, as a script) and passes ``mypy
  --strict`` with the project's settings;
- ``<!-- checked: excerpt of PATH -->``: every line but ``...`` placeholders appears in the file
  PATH, in order (PATH is itself run or type-checked elsewhere).
- ``<!-- checked: own task -->`` (or ``own task as FILE``): a step of the "Your own task" section,
  which ``tests/e2e/test_own_task.py`` runs in order (``tests/readme_task.py``; bash blocks
  too); its Python blocks pass ``mypy --strict`` here.

A block without a marker fails the first test.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_MARKER = re.compile(r"<!-- checked: (run|excerpt of (?P<path>\S+)|own task(?: as \S+)?) -->")


@attrs.frozen
class Block:
    line: int  # of the opening fence, 1-based
    marker: str | None
    code: str

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def _blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            end = lines.index("```", i + 1)
            marker = lines[i - 1].strip() if i > 0 else ""
            blocks.append(
                Block(
                    start + 1,
                    marker if _MARKER.fullmatch(marker) else None,
                    "\n".join(lines[start + 1 : end]) + "\n",
                )
            )
            i = end
        i += 1
    return blocks


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if b.marker == "<!-- checked: run -->"]
OWN_TASK = [b for b in BLOCKS if b.marker is not None and "own task" in b.marker]
EXCERPTS = [b for b in BLOCKS if b.marker is not None and "excerpt" in b.marker]


def test_every_python_block_says_how_it_is_checked() -> None:
    assert len(BLOCKS) >= 3
    unmarked = [b.name for b in BLOCKS if b.marker is None]
    assert not unmarked, f"add a '<!-- checked: ... -->' line above each of {unmarked}"


@pytest.mark.parametrize("block", EXCERPTS, ids=lambda b: b.name)
def test_excerpts_match_their_file(block: Block) -> None:
    assert block.marker is not None
    match = _MARKER.fullmatch(block.marker)
    assert match is not None and match["path"]
    source = (ROOT / match["path"]).read_text().splitlines()
    position = 0
    for line in block.code.splitlines():
        if not line.strip() or line.strip().startswith("..."):
            continue
        for j in range(position, len(source)):
            if source[j].strip() == line.strip():
                position = j + 1
                break
        else:
            pytest.fail(f"{block.name}: {line.strip()!r} is not in {match['path']} (in order)")


@pytest.mark.slow
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_runnable_blocks_run(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.code)
    result = subprocess.run(
        [sys.executable, "-W", "error", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{block.name}:\n{result.stdout}\n{result.stderr}"


@pytest.mark.slow
def test_runnable_blocks_type_check(tmp_path: Path) -> None:
    files = []
    for block in RUN + OWN_TASK:
        path = tmp_path / f"readme_{block.line}.py"
        path.write_text(block.code)
        files.append(str(path))
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
