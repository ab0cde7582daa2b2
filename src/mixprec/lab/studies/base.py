"""What every study does besides its numerics, written once: where its files go, the CSV and the plot it writes,
and the lines that say what it wrote.

A study's run takes its own config (a frozen dataclass that checks itself) and a :class:`StudyOutput`; it prints
its tables, then writes ``output.path("name.csv")`` with :func:`write_rows_csv` (dataclass rows) or
:func:`write_csv` (any rows) and, when ``output.plot``, a figure drawn on :func:`pyplot` and saved with
:func:`save_figure`, and prints :func:`wrote_lines` of the files. The defaults shared by the studies' command-line
arguments (:data:`DEFAULT_SEED`, :func:`default_out_dir`) live here, so that ``mixprec.cli.study`` states none.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_SEED",
    "OUT_ROOT",
    "PLOT_DPI",
    "StudyOutput",
    "default_out_dir",
    "pyplot",
    "save_figure",
    "wrote_lines",
    "write_csv",
    "write_rows_csv",
]

DEFAULT_SEED = 0
# Each study writes under OUT_ROOT/<its command name> unless told otherwise (--out-dir).
OUT_ROOT = Path("mixprec_out")
PLOT_DPI = 120
_NO_MATPLOTLIB = "plotting needs matplotlib: pip install 'mixprec[plot]' (or pass --no-plot)"


def default_out_dir(name: str) -> Path:
    """Where the study ``name`` (its command name, e.g. ``"reduction-error"``) writes by default."""
    return OUT_ROOT / name


@dataclass(frozen=True)
class StudyOutput:
    """Where a study's files go and whether it draws its plot."""

    out_dir: Path
    plot: bool = True

    def path(self, name: str) -> Path:
        return Path(self.out_dir) / name


def pyplot(*, required: bool = True) -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display). Without matplotlib: RuntimeError, or
    None when not ``required`` (a study that then skips its plot and says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        if not required:
            return None
        raise RuntimeError(_NO_MATPLOTLIB) from exc
    return plt


def save_figure(fig: Any, path: Path, *, dpi: int = PLOT_DPI) -> Path:
    """Lay out ``fig``, write it to ``path`` (its folder created), close it; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def write_csv(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    """``header`` and ``rows`` as CSV at ``path`` (its folder created); returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_rows_csv(rows: Sequence[Any], path: Path, *, formats: Mapping[str, str] | None = None) -> Path:
    """Dataclass ``rows`` as CSV, one column per field in field order; ``formats`` maps a field to a format spec
    (``{"rel_error": ".6e"}``), the other fields are written as ``csv`` writes them."""
    if not rows or not is_dataclass(rows[0]):
        raise ValueError("rows must be a non-empty sequence of dataclass instances")
    names = [f.name for f in fields(rows[0])]
    spec = dict(formats or {})

    def cells(row: Any) -> list[Any]:
        values = asdict(row)
        return [format(values[n], spec[n]) if n in spec else values[n] for n in names]

    return write_csv(path, names, (cells(r) for r in rows))


def wrote_lines(paths: Iterable[Path | None]) -> str:
    """The closing lines of a study: a blank line, then ``wrote PATH`` for each file written (None: skipped)."""
    return "\n" + "\n".join(f"wrote {p}" for p in paths if p is not None)
