"""What a benchmark reports to ``nox -s bench``: its ratios, as JSON with ``--json PATH``."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

__all__ = ["Ratio", "write_ratios"]


@attrs.frozen
class Ratio:
    """One measured ratio (ours / the floor it is compared with) and its target, ``<= target``."""

    benchmark: str
    measure: str
    value: float
    target: float

    @property
    def meets(self) -> bool:
        return self.value <= self.target


def write_ratios(path: Path | None, ratios: list[Ratio]) -> None:
    """Write ``ratios`` to ``path`` as JSON (nothing when ``path`` is ``None``)."""
    if path is not None:
        path.write_text(json.dumps([attrs.asdict(r) for r in ratios]) + "\n")


def read_ratios(path: Path) -> list[Ratio]:
    return [Ratio(**row) for row in json.loads(path.read_text())]
