"""The metrics log of a run (``metrics.jsonl``): one JSON object per line, written and read here only (and the
same encoding for the run's ``summary.json``).

Non-finite numbers are not JSON (``json.dumps`` would write the non-standard ``NaN``/``Infinity``): a row's
NaN or +-inf float is written as ``null`` and named in the row's ``"nonfinite"`` object (field name ->
``"nan"``, ``"inf"`` or ``"-inf"``), which is present only when such a value occurred. :func:`read_rows`
restores those values, so a reader sees the floats the trainer logged, while any other JSON tool sees valid
JSON with nulls. Logs written with bare ``NaN`` (Python's json module, older runs) still read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

__all__ = ["METRICS_NAME", "NONFINITE_KEY", "decode_row", "encode_row", "read_numbered_rows", "read_rows", "strict_row"]

METRICS_NAME = "metrics.jsonl"
NONFINITE_KEY = "nonfinite"
_NONFINITE_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _nonfinite_name(v: float) -> str:
    if math.isnan(v):
        return "nan"
    return "inf" if v > 0 else "-inf"


def strict_row(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its non-finite top-level floats replaced by None and named under ``"nonfinite"``."""
    flagged = {k: _nonfinite_name(v) for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
    if flagged:
        row = {k: (None if k in flagged else v) for k, v in row.items()}
        row[NONFINITE_KEY] = flagged
    return row


def encode_row(row: dict[str, Any]) -> str:
    """One line of strict JSON (no newline) for ``row``: non-finite floats become null and are named under
    ``"nonfinite"``."""
    return json.dumps(strict_row(row), allow_nan=False)


def decode_row(row: dict[str, Any], where: str = "row") -> dict[str, Any]:
    """Undo :func:`strict_row` in place (and return ``row``). Raises ValueError, naming ``where``, on a malformed
    ``"nonfinite"`` entry."""
    flagged = row.pop(NONFINITE_KEY, None)
    if flagged is not None:
        if not isinstance(flagged, dict) or not all(v in _NONFINITE_NAMES for v in flagged.values()):
            raise ValueError(
                f"{where}: {NONFINITE_KEY!r} must map field names to 'nan', 'inf' or '-inf'; got {flagged!r}"
            )
        for key, name in flagged.items():
            row[key] = _NONFINITE_NAMES[name]
    return row


def read_rows(path: str) -> Iterator[dict[str, Any]]:
    """The rows of a JSONL file, blank lines skipped, flagged non-finite values restored.

    Raises:
        ValueError: a line that is not a JSON object, or a malformed ``"nonfinite"`` entry, naming ``path:line``.
    """
    for _, row in read_numbered_rows(path):
        yield row


def read_numbered_rows(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """:func:`read_rows` with each row's 1-based line number (for error messages naming ``path:line``)."""
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, decode_row(row, f"{path}:{lineno}")
