"""Sweep results on disk: ``records.jsonl`` (one record per evaluated cell), read back tolerantly.

Records are appended one JSON object per line and flushed after each, so an interrupted sweep loses
at most the line being written; :func:`read_records` skips a truncated last line, and
:class:`RecordWriter` starts a fresh line after one. A record's identity (:func:`record_key`) is
``(task, policy, params, budget, length, sample, seed)``; a restarted sweep skips the cells whose key
is already present.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

RECORDS_FILE = "records.jsonl"
ERRORS_FILE = "errors.jsonl"
CellKey = tuple[str, str, str, int | None, int, int, int]


def params_key(params: Mapping[str, Any] | None) -> str:
    """Canonical JSON of policy parameters (``"{}"`` for none)."""
    return json.dumps(dict(params or {}), sort_keys=True)


def record_key(record: Mapping[str, Any]) -> CellKey:
    """The identity of the cell a record belongs to."""
    budget = record.get("budget")
    return (
        str(record["task"]),
        str(record["policy"]),
        params_key(record.get("params")),
        None if budget is None else int(budget),
        int(record["length"]),
        int(record["sample"]),
        int(record["seed"]),
    )


def clean_json(value: Any) -> Any:
    """``value`` with NaN/inf floats as ``None``, tuples as lists and tensors/numpy scalars as numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, str | bytes):  # torch / numpy values
        return clean_json(value.tolist())
    return value


#: Keys every record has (its cell and its score); a line without them is skipped with a message.
RECORD_KEYS = ("task", "policy", "budget", "length", "sample", "seed", "score")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every well-formed record in a JSONL file (a missing file gives ``[]``); lines that are not JSON
    objects with :data:`RECORD_KEYS` are skipped with a message naming the line and what is wrong."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            print(f"kvsieve: skipping malformed line {number} of {path} (interrupted write?)", file=sys.stderr)
            continue
        if not isinstance(record, dict):
            print(f"kvsieve: skipping line {number} of {path}: not a JSON object", file=sys.stderr)
            continue
        missing = [key for key in RECORD_KEYS if key not in record]
        if missing:
            print(f"kvsieve: skipping line {number} of {path}: missing {', '.join(missing)}", file=sys.stderr)
            continue
        try:
            record_key(record)
        except (TypeError, ValueError) as err:
            print(f"kvsieve: skipping line {number} of {path}: bad cell key ({err})", file=sys.stderr)
            continue
        records.append(record)
    return records


class RecordWriter:
    """Appends records to a JSONL file, one flushed line each (use as a context manager)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_with_newline()
        self._file: IO[str] = self.path.open("a", encoding="utf-8")
        if needs_newline:
            self._file.write("\n")

    def _ends_with_newline(self) -> bool:
        with self.path.open("rb") as fh:
            fh.seek(-1, 2)
            return fh.read(1) == b"\n"

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(clean_json(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def done_keys(records: Iterable[Mapping[str, Any]]) -> set[CellKey]:
    """Keys of the cells the records cover."""
    return {record_key(r) for r in records}
