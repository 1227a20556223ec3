"""Prompt files read record by record: JSON lines and Parquet.

:func:`read_records` yields each record of a ``.jsonl`` or ``.parquet`` file with where it stands
(``"path:line"``, ``"path:row N"``), so that whoever checks the record can name its place. What
cannot be read at all (a missing file, an unknown extension, bytes that are not UTF-8, a line that
is not JSON, a Parquet file without pyarrow) raises :class:`~rlcore.errors.DataError` here, naming
the file and the line and saying what to do. pyarrow is imported only for a Parquet file.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, cast

from rlcore.errors import DataError

__all__ = ["read_records"]


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    """Yields ``(where, record)`` for each non-blank line; ``where`` is ``"path:line"``."""
    try:
        # Bytes, decoded line by line, so a bad byte is reported on its own line (a text-mode file
        # decodes whole chunks and would blame the chunk's first line).
        handle = path.open("rb")
    except OSError as exc:
        raise DataError(
            f"{path}: cannot open prompt file ({exc.strerror}); check the path"
        ) from exc
    with handle:
        for line_no, raw in enumerate(handle, start=1):
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                    "re-encode the file as UTF-8"
                ) from exc
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                    "each line must hold one JSON object"
                ) from exc
            yield where, record


class _ParquetTable(Protocol):
    def to_pylist(self) -> list[dict[str, object]]: ...


class _ParquetModule(Protocol):
    """The part of ``pyarrow.parquet`` used here; pyarrow ships no type information, and this
    keeps the import lazy (only Parquet files need it)."""

    def read_table(self, source: str) -> _ParquetTable: ...


def _read_parquet(path: Path) -> Iterator[tuple[str, object]]:
    """Yields ``(where, record)`` per row; ``where`` is ``"path:row N"`` (1-based)."""
    try:
        pq = cast(_ParquetModule, importlib.import_module("pyarrow.parquet"))
    except ImportError as exc:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow; install it with pip install 'rlcore[data]' "
            "or convert the file to JSON lines"
        ) from exc
    try:
        table = pq.read_table(str(path))
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{path}: cannot read as Parquet ({exc}); check the file") from exc
    for row_no, record in enumerate(table.to_pylist(), start=1):
        yield f"{path}:row {row_no}", record


def read_records(path: Path) -> Iterator[tuple[str, object]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise DataError(
        f"{path}: unknown prompt file extension {path.suffix!r}; use .jsonl (one JSON object per "
        "line) or .parquet"
    )
