"""``mixprec report RUN``: the loss scale, skipped steps and per-layer fp16 headroom of a run, over its steps.

Reads the run's ``metrics.jsonl`` (see :mod:`mixprec.lab.metrics`): ``loss_scale`` and ``skipped`` of every row,
``culprits`` of the skipped ones, and ``headroom`` of the rows the headroom telemetry wrote
(:mod:`mixprec.lab.telemetry`, every ``training.headroom_interval`` steps). :func:`summary_lines` says in a few
lines where the scale went, which layers' gradients are underflowing (and whether that is rising), which
overflowed, and warns when the scale is falling while a layer's underflow rises: the scale is heading for its
floor. :func:`plot_telemetry` draws the same as a PNG (matplotlib, an optional dependency imported there only).
A run with the live numerics audit (``parallel.audit_every``) also has ``audit_*`` keys on its audited rows
(:meth:`mixprec.comm.live_audit.AuditResult.as_row`): the summary quotes them and :func:`plot_audit` draws the
effective bits (mixprec's reduction and the backend's own beside it) and rel_l2 (log axis) over the steps.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mixprec.comm.live_audit import AUDIT_ROW_PREFIX
from mixprec.lab.metrics import METRICS_NAME, read_step_rows
from mixprec.lab.telemetry import HEADROOM_FIELDS, HEADROOM_KEY

__all__ = ["AUDIT_SERIES", "RunTelemetry", "load_telemetry", "plot_audit", "plot_telemetry", "summary_lines"]

# The audit_* fields a report reads (the native_* ones are absent beside the native reducer: NaN then).
AUDIT_SERIES = ("effective_bits", "native_effective_bits", "rel_l2", "native_rel_l2")

_TOP_LAYERS = 3  # layers named per finding in the summary
_PLOT_LAYERS = 8  # lines per panel of the plot
_RISE = 1.1  # a fraction "rises" when its last value exceeds 1.1x its first (and is non-zero)


@dataclass
class RunTelemetry:
    """The telemetry of a run, as lists over its rows (``steps``) and over its headroom rows (``headroom_steps``).

    ``headroom[layer][kind]`` holds one fraction per headroom row (NaN where a row lacks the layer).
    """

    run_dir: str
    steps: list[int] = field(default_factory=list)
    scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    culprits: Counter[str] = field(default_factory=Counter)
    headroom_steps: list[int] = field(default_factory=list)
    headroom: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    audit_steps: list[int] = field(default_factory=list)
    audit: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in AUDIT_SERIES})
    """``audit[name]``: the ``audit_<name>`` of each audited row (NaN where a row lacks it)."""


def load_telemetry(run_dir: str) -> RunTelemetry:
    """Read ``run_dir/metrics.jsonl``. Raises ValueError (one line, naming ``path:line``) for a missing directory
    or log, an empty log, steps that ``mixprec compare`` refuses too (:func:`mixprec.lab.metrics.read_step_rows`:
    not integers in ``0..2**53``, repeated or decreasing), or a row without a loss_scale that is a finite number
    > 0 (what every loss scaler keeps), a bool skipped, or with malformed ``culprits`` or ``headroom``."""
    if not os.path.isdir(run_dir):
        raise ValueError(f"RUN {run_dir!r} is not a directory (give a mixprec train run directory)")
    path = os.path.join(run_dir, METRICS_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"RUN {run_dir!r} holds no {METRICS_NAME} (is it a mixprec train run directory?)")
    tel = RunTelemetry(run_dir)
    for where, step, row, _ in read_step_rows(path):
        scale, skipped, culprits = row.get("loss_scale"), row.get("skipped"), row.get("culprits") or []
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not isinstance(skipped, bool):
            raise ValueError(f"{where}: a metrics row needs a numeric loss_scale and a bool skipped")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{where}: 'loss_scale' must be a finite number > 0; got {scale!r}")
        if not isinstance(culprits, list) or not all(isinstance(c, str) for c in culprits):
            raise ValueError(f"{where}: 'culprits' must be a list of parameter names; got {culprits!r}")
        tel.steps.append(step)
        tel.scales.append(float(scale))
        tel.skipped.append(skipped)
        tel.culprits.update(culprits)
        if HEADROOM_KEY in row:
            _add_headroom(tel, row[HEADROOM_KEY], step, where)
        if AUDIT_ROW_PREFIX + "rel_l2" in row:
            _add_audit(tel, row, step, where)
    if not tel.steps:
        raise ValueError(f"{path} holds no rows (the run has not logged a step yet)")
    return tel


def _add_headroom(tel: RunTelemetry, headroom: object, step: int, where: str) -> None:
    ok = isinstance(headroom, dict) and all(
        isinstance(v, dict) and all(isinstance(v.get(k), int | float) for k in HEADROOM_FIELDS)
        for v in headroom.values()
    )
    if not ok:
        raise ValueError(f"{where}: {HEADROOM_KEY!r} must map layers to {{{', '.join(HEADROOM_FIELDS)}}} fractions")
    n = len(tel.headroom_steps)
    tel.headroom_steps.append(step)
    for layer, values in headroom.items():  # type: ignore[union-attr]
        series = tel.headroom.setdefault(layer, {k: [math.nan] * n for k in HEADROOM_FIELDS})
        for k in HEADROOM_FIELDS:
            series[k].append(float(values[k]))
    for series in tel.headroom.values():  # a layer this row lacks
        for k in HEADROOM_FIELDS:
            series[k] += [math.nan] * (n + 1 - len(series[k]))


def _add_audit(tel: RunTelemetry, row: dict, step: int, where: str) -> None:
    values = {}
    for name in AUDIT_SERIES:
        v = row.get(AUDIT_ROW_PREFIX + name, math.nan)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{where}: {AUDIT_ROW_PREFIX + name!r} must be a number; got {v!r}")
        values[name] = float(v)
    tel.audit_steps.append(step)
    for name, v in values.items():
        tel.audit[name].append(v)


def _audit_lines(tel: RunTelemetry) -> list[str]:
    if not tel.audit_steps:
        return []
    bits = [v for v in tel.audit["effective_bits"] if math.isfinite(v)]
    native = [v for v in tel.audit["native_effective_bits"] if math.isfinite(v)]
    rel = tel.audit["rel_l2"]
    worst = max(range(len(rel)), key=lambda i: (rel[i] if not math.isnan(rel[i]) else -1.0, -i))
    line = (
        f"live audit: {len(tel.audit_steps)} audit(s), steps {tel.audit_steps[0]}..{tel.audit_steps[-1]}: "
        f"effective bits {min(bits, default=math.nan):.1f}..{max(bits, default=math.nan):.1f}"
    )
    if native:
        line += f" (the backend's own reduction: {min(native):.1f}..{max(native):.1f})"
    return [line + f"; worst rel_l2 {rel[worst]:.3g} at step {tel.audit_steps[worst]}"]


def _pct(v: float) -> str:
    return f"{100 * v:.3g}%"


def _trend(values: list[float]) -> tuple[str, float | None, int | None]:
    """'rising', 'falling' or 'steady' from the first finite value to the last, with that first value's index."""
    finite = [(i, v) for i, v in enumerate(values) if math.isfinite(v)]
    if len(finite) < 2:
        return "steady", None, None
    (i0, first), (_, last) = finite[0], finite[-1]
    if last > first * _RISE and last > 0:
        return "rising", first, i0
    if first > last * _RISE and first > 0:
        return "falling", first, i0
    return "steady", first, i0


def _last(values: list[float]) -> float:
    """The last finite value (0.0 when none: a layer missing from every row)."""
    return next((v for v in reversed(values) if math.isfinite(v)), 0.0)


def summary_lines(tel: RunTelemetry) -> list[str]:
    """A short text summary of the loss scale, the skipped steps, their culprits and the headroom."""
    n_skipped = sum(tel.skipped)
    lo = min(range(len(tel.scales)), key=lambda i: (tel.scales[i], i))
    lines = [
        f"steps {tel.steps[0]}..{tel.steps[-1]}: loss scale {tel.scales[0]:g} -> {tel.scales[-1]:g} "
        f"(lowest {tel.scales[lo]:g} at step {tel.steps[lo]}); {n_skipped} skipped step(s)"
        + (
            f", the last at step {max(s for s, k in zip(tel.steps, tel.skipped, strict=True) if k)}"
            if n_skipped
            else ""
        )
    ]
    if tel.culprits:
        named = ", ".join(f"{name} ({count})" for name, count in tel.culprits.most_common(_TOP_LAYERS))
        lines.append(f"overflowing parameters, most often first: {named}")
    lines += _audit_lines(tel)
    if not tel.headroom_steps:
        lines.append("no headroom telemetry in this run (training.headroom_interval is 0 or exceeds the steps)")
        return lines
    at = tel.headroom_steps[-1]
    for kind, verb in (
        ("underflow", "would underflow in fp16"),
        ("subnormal", "would be subnormal in fp16"),
        ("overflow", "would overflow in fp16"),
        ("nonfinite", "were inf/NaN already"),
        ("zero", "were exactly zero"),
    ):
        worst = sorted(tel.headroom, key=lambda layer: -_last(tel.headroom[layer][kind]))[:_TOP_LAYERS]
        for layer in worst:
            series = tel.headroom[layer][kind]
            last = _last(series)
            if not last > 0:
                break
            trend, first, i0 = _trend(series)
            if kind == "zero" and trend != "rising":
                continue  # exact zeros matter when they rise: in an fp16 run, an underflowed value is a zero
            since = (
                f" (from {_pct(first)} at step {tel.headroom_steps[i0]})"
                if trend != "steady" and i0 is not None
                else ""
            )
            lines.append(f"layer {layer}: {_pct(last)} of gradients {verb} at step {at}, {trend}{since}")
    if len(lines) == 1 + bool(tel.culprits) + bool(tel.audit_steps):
        lines.append(f"headroom at step {at}: no layer's gradients underflow, are subnormal or overflow in fp16")
    rising = [layer for layer in tel.headroom if _trend(tel.headroom[layer]["underflow"])[0] == "rising"]
    if rising and tel.scales[-1] < tel.scales[0]:
        lines.append(
            f"warning: the loss scale fell from {tel.scales[0]:g} to {tel.scales[-1]:g} while the underflow of "
            f"{', '.join(rising[:_TOP_LAYERS])} rose: the scale is heading for collapse"
        )
    return lines


def _pyplot() -> object:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # an optional dependency, imported here only
        raise RuntimeError("the report plot needs matplotlib: pip install 'mixprec[plot]' (or pass --no-plot)") from exc
    return plt


def plot_audit(tel: RunTelemetry, path: str) -> str:
    """The live audit over the steps as a PNG at ``path``; returns it: effective bits of mixprec's reduction and
    of the backend's own beside it, and rel_l2 on a log axis (an exact result, rel_l2 = 0, is drawn at 2^-53:
    the fp64 reference's own resolution). ValueError when the run has no audit rows; RuntimeError without
    matplotlib."""
    if not tel.audit_steps:
        raise ValueError(f"{tel.run_dir}: no audit_* rows (the run had parallel.audit_every = 0, or one rank)")
    plt: Any = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    steps = tel.audit_steps
    for ax, (ours, theirs), ylabel in (
        (axes[0], ("effective_bits", "native_effective_bits"), "effective bits (-log2 rel_l2)"),
        (axes[1], ("rel_l2", "native_rel_l2"), "rel_l2 against the exact sum"),
    ):
        for name, label, style in ((ours, "mixprec", "-"), (theirs, "backend's own", "--")):
            values = tel.audit[name]
            if name.endswith("rel_l2"):
                values = [max(v, 2.0**-53) if math.isfinite(v) else math.nan for v in values]
            if any(math.isfinite(v) for v in values):
                ax.plot(steps, values, style, marker=".", label=label)
        ax.set_ylabel(ylabel)
        ax.legend(loc="best", fontsize="small")
    axes[1].set_yscale("log", base=2)
    axes[0].set_title(
        f"{os.path.basename(os.path.abspath(tel.run_dir))}: live numerics audit of the gradient reduction"
    )
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_telemetry(tel: RunTelemetry, path: str) -> str:
    """Loss scale (skipped steps marked), per-layer underflow and subnormal, and per-layer overflow, over the steps,
    as a PNG at ``path``; returns it.

    Raises:
        RuntimeError: matplotlib is not installed (``pip install 'mixprec[plot]'``).
    """
    plt: Any = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    ax = axes[0]
    ax.step(tel.steps, tel.scales, where="post", label="loss scale")
    skipped = [(s, v) for s, v, k in zip(tel.steps, tel.scales, tel.skipped, strict=True) if k]
    if skipped:
        ax.plot(*zip(*skipped, strict=True), "x", color="tab:red", label="skipped step")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("loss scale")
    ax.legend(loc="best", fontsize="small")
    ax.set_title(f"{os.path.basename(os.path.abspath(tel.run_dir))}: loss scale and fp16 headroom of the gradients")
    for ax, kinds, label in (
        (axes[1], ("underflow", "subnormal"), "underflow (solid) / subnormal (dotted), %"),
        (axes[2], ("overflow", "nonfinite"), "overflow (solid) / inf/NaN already (dotted), %"),
    ):
        layers = sorted(tel.headroom, key=lambda layer: -max(_last(tel.headroom[layer][k]) for k in kinds))
        for i, layer in enumerate(layers[:_PLOT_LAYERS]):
            color = f"C{i % 10}"
            for kind, style in zip(kinds, ("-", ":"), strict=False):
                values = [100 * v for v in tel.headroom[layer][kind]]
                ax.plot(
                    tel.headroom_steps,
                    values,
                    style,
                    marker=".",
                    color=color,
                    label=layer if kind == kinds[0] else None,
                )
        ax.set_ylabel(label)
        if layers:
            ax.legend(loc="best", fontsize="x-small", ncol=2)
        else:
            ax.text(0.5, 0.5, "no headroom telemetry in this run", ha="center", va="center", transform=ax.transAxes)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
