"""Progress bars, drawn only where someone watches them.

A bar redraws itself with carriage returns: on a terminal it is one moving line, in a log file or a pipe it is
hundreds of lines of ``\\r`` noise. Every bar mixprec draws comes from :func:`progress_bar`, on stderr; with
``enabled=None`` (the default of the CLI's ``--progress`` flags) it is drawn only when stderr is a terminal,
which is tqdm's own ``disable=None`` rule. ``True`` draws it anyway, ``False`` never. tqdm is imported on first
use, so that ``import mixprec`` stays light.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

__all__ = ["is_terminal", "progress_bar", "resolve_progress"]


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: the current ``sys.stderr``) is a terminal; False for a closed or odd stream."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed file
        return False


def resolve_progress(enabled: bool | None) -> bool:
    """``enabled``, with None meaning "when stderr is a terminal"; for callers that hand a plain bool on."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"progress must be True, False or None (when stderr is a terminal); got {enabled!r}")
    return is_terminal() if enabled is None else enabled


def progress_bar(
    *,
    total: int,
    desc: str | None = None,
    unit: str = "it",
    enabled: bool | None = None,
    initial: int = 0,
    leave: bool = True,
) -> Any:
    """A tqdm bar on stderr, disabled (no output at all) unless :func:`resolve_progress` says to draw it."""
    from tqdm.auto import tqdm

    draw = resolve_progress(enabled)
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        initial=initial,
        leave=leave,
        disable=not draw,
        file=sys.stderr,
        dynamic_ncols=True,
    )
