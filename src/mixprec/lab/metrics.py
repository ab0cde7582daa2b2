"""The metrics log of a run (``metrics.jsonl``): one JSON object per line, written and read here only (and the
same encoding for the run's ``summary.json``).

Non-finite numbers are not JSON (``json.dumps`` would write the non-standard ``NaN``/``Infinity``): a row's
NaN or +-inf float is written as ``null`` and named in the row's ``"nonfinite"`` object (field name ->
``"nan"``, ``"inf"`` or ``"-inf"``), which is present only when such a value occurred. :func:`read_rows`
restores those values, so a reader sees the floats the trainer logged, while any other JSON tool sees valid
JSON with nulls. Logs written with bare ``NaN`` (Python's json module, older runs) still read. A run killed
mid-write may leave a torn last line: :func:`truncate_metrics` (called on resume) drops it with a notice.
:func:`read_step_rows` is the one check of a log's steps that every reader (``mixprec compare``, ``mixprec
report``) applies: integers in ``0..MAX_STEP``, increasing down the file as ``mixprec train`` writes them.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "DUPLICATE_RULES",
    "MAX_STEP",
    "METRICS_NAME",
    "NONFINITE_KEY",
    "SUMMARY_NAME",
    "decode_row",
    "encode_row",
    "read_numbered_rows",
    "read_rows",
    "read_step_rows",
    "strict_row",
    "summarize_run",
    "truncate_metrics",
    "write_summary",
]

METRICS_NAME = "metrics.jsonl"
SUMMARY_NAME = "summary.json"
NONFINITE_KEY = "nonfinite"
_NONFINITE_NAMES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# The largest step a row may carry: 2**53, the largest integer that every JSON reader (a double) keeps exactly.
MAX_STEP = 2**53
# What a step logged on two rows means: refuse the log, or keep the later row (a resumed run appended to a log
# without dropping the rows after its checkpoint).
DUPLICATE_RULES = ("error", "last")


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
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (is {path!r} a metrics log?)") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({exc.msg})") from None
            except RecursionError:
                raise ValueError(f"{path}:{lineno}: JSON nested too deeply to be a metrics row") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, decode_row(row, f"{path}:{lineno}")


def read_step_rows(
    path: str,
    *,
    duplicates: str = "error",
    counts: Callable[[dict[str, Any]], bool] | None = None,
    hint: str = "",
) -> Iterator[tuple[str, int, dict[str, Any], bool]]:
    """The rows of a metrics log whose step is checked: ``(where, step, row, repeated)``, ``where`` being
    ``path:line``.

    Every row needs a ``step``: an integer in ``0..MAX_STEP``. Among the rows that ``counts`` accepts (all by
    default; the others are checked and skipped), each step must exceed the one before, as ``mixprec train``
    logs them. With ``duplicates="last"`` a step may also go back (a resumed run appended to the log without
    dropping the rows after its checkpoint); ``repeated`` is then true for a row whose step an earlier row had,
    and that later row is the one to keep. ``hint`` is appended to the message of a step that repeats or goes
    back (what the caller offers instead, e.g. a flag).

    Raises:
        ValueError: naming ``path:line`` (and, for a repeat, the line of the first row), on any of the above or
            on a line that :func:`read_numbered_rows` refuses.
    """
    if duplicates not in DUPLICATE_RULES:
        raise ValueError(f"duplicates must be one of {', '.join(map(repr, DUPLICATE_RULES))}; got {duplicates!r}")
    first_line: dict[int, int] = {}
    last: int | None = None
    for lineno, row in read_numbered_rows(path):
        where = f"{path}:{lineno}"
        if "step" not in row:
            raise ValueError(f"{where}: no 'step' field")
        step = row["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{where}: 'step' must be an integer; got {step!r}")
        if not 0 <= step <= MAX_STEP:
            raise ValueError(f"{where}: 'step' must lie in 0..2**53 (a count of optimizer steps); got {step}")
        if counts is not None and not counts(row):
            continue
        repeated = step in first_line
        if duplicates == "error" and repeated:
            raise ValueError(f"{where}: step {step} is logged again (first at line {first_line[step]}){hint}")
        if duplicates == "error" and last is not None and step < last:
            raise ValueError(f"{where}: step {step} follows step {last}: the steps of a log must increase{hint}")
        first_line.setdefault(step, lineno)
        last = step
        yield where, step, row, repeated


def truncate_metrics(path: str, before_step: int) -> None:
    """Keep only rows of steps < ``before_step`` (a run killed after its last checkpoint logged more). A torn
    last line (the run was killed while writing it) is dropped with a one-line notice; a bad line elsewhere is
    an error (ValueError naming ``path:line``)."""
    if not os.path.exists(path):
        return
    with open(path) as fh:
        lines = fh.read().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            print(
                f"mixprec train: {path}:{len(lines)}: dropped a torn last line (the run was killed while writing "
                f"it): {lines[-1][:60]!r}",
                file=sys.stderr,
                flush=True,
            )
            lines.pop()
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write("".join(line + "\n" for line in lines))
    kept = [row for row in read_rows(tmp) if row.get("step", -1) < before_step]
    with open(tmp, "w") as fh:
        fh.write("".join(encode_row(row) + "\n" for row in kept))
    os.replace(tmp, path)


def summarize_run(metrics_path: str, *, parameters: int, corpus: Any) -> dict[str, Any]:
    """The run's summary (summary.json) from its metrics log."""
    rows = list(read_rows(metrics_path))
    losses = [r["loss"] for r in rows]
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None]
    finite = [v for v in losses if math.isfinite(v)]
    return {
        "steps": len(rows),
        "final_loss": losses[-1] if losses else None,
        "best_loss": min(finite) if finite else None,
        "final_eval_loss": evals[-1] if evals else None,
        "skipped_steps": sum(1 for r in rows if r.get("skipped")),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows) if rows else None,
        "wall_time": rows[-1]["wall_time"] if rows else 0.0,
        "parameters": parameters,
        "corpus": corpus.name,
        "corpus_sha256": corpus.sha256,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }


def write_summary(summary: dict[str, Any], path: str) -> None:
    """summary.json as strict JSON (a NaN final loss: null and "nonfinite")."""
    with open(path, "w") as fh:
        json.dump(strict_row(summary), fh, indent=2, allow_nan=False)
        fh.write("\n")
