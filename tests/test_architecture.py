"""The architecture is a checked contract: rlcore's rooms are layered, no package has an import
circle, the core imports no backend, and no module of ``src/`` outgrows 600 lines.

The contracts live in pyproject.toml (``[tool.importlinter]``) and ``nox -s lint`` runs them; these
tests run them too, and show that they fail, naming the import, when a copy of the tree is given
an upward import or a circle.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def _lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """src/ and pyproject.toml, copied: a tree to break."""
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text() + code)


def test_the_tree_keeps_its_import_contracts() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_layers_and_is_named(tree_copy: Path) -> None:
    # A shared type reaching up into the loop, even lazily inside a function.
    _append(
        tree_copy / "src/rlcore/specs.py",
        "\n\ndef _seeded() -> None:\n    from rlcore.loop.plan import TrainPlan  # noqa: F401\n",
    )
    result = _lint_imports(tree_copy)
    assert result.returncode == 1
    assert "rlcore.specs is not allowed to import rlcore.loop" in result.stdout
    assert "rlcore.specs -> rlcore.loop.plan" in result.stdout


def test_a_circle_inside_a_room_is_refused_and_named(tree_copy: Path) -> None:
    # Two modules of the config room importing each other: no layer is crossed, but a circle is.
    _append(
        tree_copy / "src/rlcore/config/fields.py",
        "\n\ndef _seeded() -> None:\n"
        "    from rlcore.config.run_config import RunConfig  # noqa: F401\n",
    )
    result = _lint_imports(tree_copy)
    assert result.returncode == 1
    assert "No cycles are allowed in rlcore.config" in result.stdout
    assert ".fields -> .run_config" in result.stdout


def test_the_core_may_not_import_a_backend(tree_copy: Path) -> None:
    _append(
        tree_copy / "src/rlcore/loop/training.py",
        "\n\ndef _seeded() -> None:\n    import rlcore_megatron  # noqa: F401\n",
    )
    result = _lint_imports(tree_copy)
    assert result.returncode == 1
    assert "rlcore.loop.training -> rlcore_megatron" in result.stdout


def test_the_launcher_may_not_import_a_backend(tree_copy: Path) -> None:
    """The launcher finds backends by name (rlcore.backends): importing one is refused."""
    _append(
        tree_copy / "src/rlcore/launch/cli.py",
        "\n\ndef _seeded() -> None:\n"
        "    from rlcore_megatron.backend import MegatronBackend  # noqa: F401\n",
    )
    result = _lint_imports(tree_copy)
    assert result.returncode == 1
    assert "rlcore.launch.cli -> rlcore_megatron.backend" in result.stdout


def test_a_backend_may_not_import_the_launcher_or_an_engine(tree_copy: Path) -> None:
    """A backend package knows only the core below it: not the launcher above it (its
    command-line entry aside), not an engine package beside it."""
    _append(
        tree_copy / "src/rlcore_megatron/stacks.py",
        "\n\ndef _seeded() -> None:\n"
        "    import rlcore.launch.record  # noqa: F401\n"
        "    import rlcore_sglang.client  # noqa: F401\n",
    )
    result = _lint_imports(tree_copy)
    assert result.returncode == 1
    assert "rlcore_megatron.stacks -> rlcore.launch.record" in result.stdout
    assert "rlcore_megatron.stacks -> rlcore_sglang.client" in result.stdout


def test_no_module_of_src_is_over_500_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in (ROOT / "src").rglob("*.py")
    }
    assert sizes, "no source files found"
    too_long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"split these modules (at most {MAX_LINES} lines each): {too_long}"
