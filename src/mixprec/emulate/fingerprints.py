"""Infer how a matmul accumulates, from crafted inputs: ``fingerprint(fn, dtype)``.

Each probe is one dot product of exactly representable terms (a large ``B``, its negative ``-B`` and small
addends), placed on the diagonal of an ``(m, k) @ (k, n)`` call to ``fn``; whether a small addend survives the
cancellation of ``B`` tells one fact about the accumulation. In this order: are products exact; the effective
precision of adding to a large accumulator and its rounding (nearest or truncation); the alignment width
inside one fused group; the size of the groups summed exactly (``k_group``); the promotion interval; split-K
(an interval that scales with K). The result is a :class:`~mixprec.emulate.MatmulModel`, named after the preset
it equals, with the fraction of the outputs of a random ``(m, k) @ (k, n)`` product that it reproduces bit for
bit. The steps are in :mod:`mixprec.emulate.probing`; the probes, their assumptions and their limits in
docs/audit.md.

:meth:`Fingerprint.save` / :meth:`Fingerprint.load` keep a result as JSON; :func:`load_model` reads back its
:class:`MatmulModel`, which ``mixprec.emulate.matmul(a, b, mode=model)`` then uses.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mixprec.core.formats import FORMAT_PRESETS, FloatFormat, get_format
from mixprec.core.progress import progress_bar, resolve_progress
from mixprec.core.validate import check_positive_int
from mixprec.emulate.matmul import MatmulModel
from mixprec.emulate.probing import (
    BITS_SCAN,
    MAX_GROUP,
    Prober,
    Scales,
    build_model,
    scan_precision,
    scan_promotion,
    scan_rounding_and_group,
    score_model,
)

__all__ = [
    "FINGERPRINT_DTYPES",
    "Fingerprint",
    "fingerprint",
    "load_model",
    "model_from_dict",
    "model_to_dict",
]

FINGERPRINT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_FILE_FORMAT = "mixprec-matmul-fingerprint"
_FILE_VERSION = 1
# The group scan needs positions up to MAX_GROUP + 1 and a final -B beyond them, hence the minimum k.
_MIN_K = 2 * MAX_GROUP
# What the probe can report, and so what a fingerprint file may hold: the group scan tries positions 2 ..
# MAX_GROUP + 1, the promotion scans lie below 2 k, the effective-bits and alignment scans reach 2**-BITS_SCAN.
_MAX_K_GROUP = MAX_GROUP + 1
_BITS_SCAN = BITS_SCAN
_ROUNDINGS = ("nearest", "toward_zero", "other")


@dataclass(frozen=True)
class Fingerprint:
    """What :func:`fingerprint` inferred. Precisions count the implicit bit (fp32: 24, fp16: 11, bf16: 8).

    Attributes:
        inputs, output: the operand format and the format of ``fn``'s result (``None`` for fp64).
        m, n, k: the shape of the calls (probes and the random check).
        products_exact: ``a_k b_k`` entered the sum exactly (all ``2p`` bits).
        effective_bits: precision at which a small addend to a large accumulated value is kept (the smaller of
            the accumulator's precision and the alignment width + 1); ``None`` = more than measurable (30).
        rounding: "nearest", "toward_zero" (truncation) or "other", of that addition.
        align_bits: fraction bits kept when a fused group is aligned to its largest term; ``None`` = the group
            is summed exactly (no truncation seen up to 2**-30).
        k_group: products summed together before each accumulator rounding (one MMA's K).
        promote_every: products between promotions of the accumulator into fp32 (or a CPU BLAS's K blocking);
            ``None`` = none seen below k / 2.
        split_k: K is split into this many slices whose partial sums are added (the interval scaled with K);
            ``None`` = no split seen. The model then uses ``promote_every = k / split_k``, right at this k only.
        model: the inferred :class:`MatmulModel`; ``preset``: the preset it equals apart from ``output``
            (``None``: a custom model); ``closest_preset``: the preset of the same inputs with the highest
            ``preset_bit_equal`` (each scored with the model's ``output``).
        bit_equal: fraction of the outputs of ``fn`` on random N(0, 1) operands that ``model`` reproduces bit
            for bit; ``probe_agreement``: the same over the crafted probes.
        notes: caveats found on the way (ambiguities, behaviour the model cannot express).
    """

    inputs: str
    output: str | None
    m: int
    n: int
    k: int
    products_exact: bool
    effective_bits: int | None
    rounding: str
    align_bits: int | None
    k_group: int
    promote_every: int | None
    split_k: int | None
    model: MatmulModel
    preset: str | None
    closest_preset: str | None
    bit_equal: float
    probe_agreement: float
    preset_bit_equal: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    label: str = ""

    def summary(self) -> str:
        """One paragraph: the inferred parameters, the model and its bit-equal fractions."""
        bits = ">30" if self.effective_bits is None else str(self.effective_bits)
        align = "exact group sums" if self.align_bits is None else f"aligned to {self.align_bits} fraction bits"
        promote = "none" if self.promote_every is None else str(self.promote_every)
        name = self.preset or "custom"
        if self.preset and self.model.output is not None:
            name += f" + {self.model.output.name} output"
        lines = [
            f"{self.label or 'matmul'} [{self.inputs} -> {self.output or 'fp64'}, m=n={self.m}, k={self.k}]:",
            f"  products {'exact' if self.products_exact else 'ROUNDED'}; accumulation keeps {bits} bits, "
            f"rounding {self.rounding}; {align}; k_group {self.k_group}; promotion every {promote}; "
            f"split-K {self.split_k or 'none'}",
            f"  model: {self.model.name} ({name}); bit-equal {self.bit_equal:.1%} on random data, "
            f"{self.probe_agreement:.1%} of the probes",
        ]
        if self.preset is None and self.closest_preset is not None:
            lines.append(
                f"  closest preset: {self.closest_preset} (bit-equal {self.preset_bit_equal[self.closest_preset]:.1%})"
            )
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able fields; ``model`` as :func:`model_to_dict`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model"] = model_to_dict(self.model)
        out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Fingerprint:
        """The inverse of :meth:`to_dict`. Every field must lie in the range :func:`fingerprint` can report
        (ValueError or TypeError naming the field): ``k_group`` in 1..257, ``promote_every`` and ``split_k`` below
        ``2 k``, and so on; a hand-edited ``k_group = 2**29`` would otherwise make each emulated matmul sum
        hundreds of millions of padding products."""
        if not isinstance(data, dict):
            raise TypeError(f"a fingerprint must be a dict; got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(data) - {"preset_bit_equal", "notes", "label"})
        if missing:
            raise ValueError(f"fingerprint is missing {', '.join(missing)}")
        kwargs = {k: v for k, v in data.items() if k in names}
        _check_probe_ranges(kwargs)
        kwargs["model"] = model_from_dict(data["model"])
        k = kwargs["k"]
        _check_range("model.k_group", kwargs["model"].k_group, 1, _MAX_K_GROUP)
        if kwargs["model"].promote_every is not None:
            _check_range("model.promote_every", kwargs["model"].promote_every, 1, 2 * k - 1)
        kwargs["notes"] = tuple(data.get("notes", ()))
        return cls(**kwargs)

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write this fingerprint as JSON (atomically); returns the path."""
        path = os.fspath(path)
        payload = {"format": _FILE_FORMAT, "version": _FILE_VERSION, **self.to_dict()}
        tmp = path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Fingerprint:
        """Read a file written by :meth:`save` (ValueError or TypeError naming the path if it is not one: not a
        regular file, not JSON, or a field out of :meth:`from_dict`'s ranges)."""
        path = os.fspath(path)
        if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block the read
            raise ValueError(f"cannot read a fingerprint from {path!r}: not a regular file")
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read a fingerprint from {path!r}: {exc}") from None
        except RecursionError:
            raise ValueError(f"cannot read a fingerprint from {path!r}: JSON nested too deeply") from None
        if not isinstance(data, dict) or data.get("format") != _FILE_FORMAT:
            raise ValueError(f"{path!r} is not a matmul fingerprint (no 'format': {_FILE_FORMAT!r})")
        if data.get("version") != _FILE_VERSION:
            raise ValueError(f"{path!r} has fingerprint version {data.get('version')!r}; this mixprec reads 1")
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as exc:  # the file's fields, checked by from_dict: name the file too
            raise type(exc)(f"{path!r}: {exc}") from None


def _check_range(name: str, value: Any, low: int, high: int | None = None, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        none = " or null" if optional else ""
        raise TypeError(f"fingerprint field {name} must be an integer{none}; got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"fingerprint field {name} must be in {bound} (what the probe can report); got {value}")


def _check_probe_ranges(fields: dict[str, Any]) -> None:
    """The ranges of :func:`_fingerprint`'s results (``m``, ``n``, ``k`` as ``fingerprint`` accepts them)."""
    _check_range("m", fields["m"], 2)
    _check_range("n", fields["n"], 2)
    _check_range("k", fields["k"], _MIN_K)
    k = fields["k"]
    _check_range("k_group", fields["k_group"], 1, _MAX_K_GROUP)
    _check_range("promote_every", fields["promote_every"], 1, 2 * k - 1, optional=True)
    _check_range("split_k", fields["split_k"], 1, k, optional=True)
    _check_range("effective_bits", fields["effective_bits"], 2, _BITS_SCAN, optional=True)
    _check_range("align_bits", fields["align_bits"], 1, _BITS_SCAN - 1, optional=True)
    if not isinstance(fields["products_exact"], bool):
        raise TypeError(f"fingerprint field products_exact must be true or false; got {fields['products_exact']!r}")
    if fields["rounding"] not in _ROUNDINGS:
        raise ValueError(f"fingerprint field rounding must be one of {', '.join(map(repr, _ROUNDINGS))}")
    for name in ("bit_equal", "probe_agreement"):
        value = fields[name]
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ValueError(f"fingerprint field {name} must be a fraction in [0, 1]; got {value!r}")


def load_model(path: str | os.PathLike[str]) -> MatmulModel:
    """The :class:`MatmulModel` of a fingerprint file written by :meth:`Fingerprint.save`."""
    return Fingerprint.load(path).model


# ---------------------------------------------------------------------------------------------- model <-> JSON
def _format_to_json(fmt: FloatFormat | None) -> str | dict[str, Any] | None:
    if fmt is None:
        return None
    if FORMAT_PRESETS.get(fmt.name) == fmt:
        return fmt.name
    return {
        "exp_bits": fmt.exp_bits,
        "man_bits": fmt.man_bits,
        "has_inf": fmt.has_inf,
        "saturate": fmt.saturate,
        "subnormals": fmt.subnormals,
        "name": fmt.name,
    }


def _format_from_json(value: Any, arg: str) -> FloatFormat | None:
    if value is None or isinstance(value, str):
        return None if value is None else get_format(value, arg=arg)
    if isinstance(value, dict):
        exp_bits, man_bits = value.get("exp_bits"), value.get("man_bits")
        flags = {k: value[k] for k in ("has_inf", "saturate", "subnormals", "name") if k in value}
        return FloatFormat(exp_bits, man_bits, **flags)
    raise TypeError(f"{arg} must be a format name or a dict of FloatFormat fields; got {type(value).__name__}")


def model_to_dict(model: MatmulModel) -> dict[str, Any]:
    """A :class:`MatmulModel` as JSON-able fields (formats by preset name, or their fields when custom)."""
    return {
        "inputs": _format_to_json(model.inputs),
        "accumulator": _format_to_json(model.accumulator),
        "k_group": model.k_group,
        "promote_every": model.promote_every,
        "output": _format_to_json(model.output),
        "align_bits": model.align_bits,
        "align_rounding": model.align_rounding,
        "name": model.name,
    }


def model_from_dict(data: dict[str, Any]) -> MatmulModel:
    """Inverse of :func:`model_to_dict` (MatmulModel validates the fields)."""
    if not isinstance(data, dict):
        raise TypeError(f"a matmul model must be a dict; got {type(data).__name__}")
    unknown = set(data) - {f.name for f in dataclasses.fields(MatmulModel)}
    if unknown:
        raise ValueError(f"unknown matmul model fields: {', '.join(sorted(unknown))}")
    kwargs = dict(data)
    for key in ("inputs", "accumulator", "output"):
        if key in kwargs:
            kwargs[key] = _format_from_json(kwargs[key], key)
    return MatmulModel(**kwargs)


def fingerprint(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    dtype: torch.dtype,
    *,
    m: int = 64,
    n: int = 64,
    k: int = 512,
    device: str | torch.device = "cpu",
    seed: int = 0,
    label: str = "",
    progress: bool | None = False,
) -> Fingerprint:
    """Infer how ``fn(a, b)`` (a matmul of ``dtype`` operands) accumulates, and the model that reproduces it.

    Args:
        fn: called as ``fn(a, b)`` with ``a (m, K)`` and ``b (K, n)`` of ``dtype`` on ``device`` (K = ``k`` and
            ``2 k``, the latter for split-K); must return an ``(m, n)`` floating-point tensor. E.g. ``torch.matmul``,
            ``lambda a, b: mixprec.emulate.matmul(a, b, mode="fp16/16")``, or a wrapper of ``torch._scaled_mm``.
        dtype: operand dtype, one of ``FINGERPRINT_DTYPES`` (fp32, fp16, bf16, float8_e4m3fn, float8_e5m2).
        m, n: output shape of each call, >= 2 (``min(m, n)`` probes per call; GEMM libraries pick kernels by shape,
            so use the shape you care about).
        k: dot-product length, >= 512 (the group scan looks up to 256). Promotion and split-K are looked for at
            ``k`` and ``2 k``; a CPU BLAS's K blocking can depend on K (MKL's does), so probe the k you use.
        device: where the operands are built.
        seed: seed of the random operands of the bit-equal check.
        label: a name for the summary.
        progress: a tqdm bar over the calls on stderr: True, False, or None for "when stderr is a terminal".

    Returns:
        A :class:`Fingerprint`. Cost: about ``600 / min(m, n) + 2`` calls of ``fn`` plus emulations of the
        model (a second or two for the emulator's presets on a CPU).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, e.g. torch.matmul; got {type(fn).__name__}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype; got {type(dtype).__name__} {dtype!r}")
    if dtype not in FINGERPRINT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, FINGERPRINT_DTYPES))}; got {dtype}")
    check_positive_int("m", m, minimum=2)
    check_positive_int("n", n, minimum=2)
    check_positive_int("k", k, minimum=_MIN_K)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int; got {type(seed).__name__}")
    draw = resolve_progress(progress)
    device = torch.device(device)

    bar = None
    if draw:
        calls = -(-600 // min(m, n)) + 4
        bar = progress_bar(total=calls, desc=f"probe {label or dtype}", unit="call", enabled=True, leave=False)
    try:
        return _fingerprint(fn, dtype, m, n, k, device, seed, label, bar)
    finally:
        if bar is not None:
            bar.close()


def _fingerprint(
    fn: Callable[..., torch.Tensor],
    dtype: torch.dtype,
    m: int,
    n: int,
    k: int,
    device: torch.device,
    seed: int,
    label: str,
    bar: Any,
) -> Fingerprint:
    """The steps of :mod:`mixprec.emulate.probing`, in order, each on what the previous ones found."""
    pr = Prober(fn, dtype, device, m, n, bar)
    fin = pr.fmt
    notes: list[str] = []
    with torch.no_grad():
        out_dtype = pr.call(
            torch.zeros(m, k, dtype=dtype, device=device), torch.zeros(k, n, dtype=dtype, device=device)
        ).dtype
    out_fmt = None if out_dtype == torch.float64 else get_format(out_dtype, arg="fn's result dtype")
    out_emin = -1022 if out_fmt is None else out_fmt.emin
    scales = Scales.of(fin, k)

    products_exact, bits, align = scan_precision(pr, scales, k, out_emin, notes)
    q = bits if bits is not None else scales.j_max + 1
    if bits is None:
        notes.append(f"the accumulation kept every addend down to 2**-{scales.j_max} of B: wider than the model's fp32")
    rounding, g = scan_rounding_and_group(pr, scales, k, q, align, notes)
    promote, split_k, g = scan_promotion(pr, scales, k, q, g, notes)
    model, preset, align = build_model(fin, out_fmt, q=q, align=align, rounding=rounding, g=g, promote=promote)
    bit_equal, agreement, scores, closest = score_model(pr, model, k, seed)
    return Fingerprint(
        inputs=fin.name,
        output=None if out_fmt is None else out_fmt.name,
        m=m,
        n=n,
        k=k,
        products_exact=products_exact,
        effective_bits=bits,
        rounding=rounding,
        align_bits=None if align == 40 else align,
        k_group=g,
        promote_every=promote,
        split_k=split_k,
        model=model,
        preset=preset,
        closest_preset=closest,
        bit_equal=bit_equal,
        probe_agreement=agreement,
        preset_bit_equal=scores,
        notes=tuple(notes),
        label=label,
    )
