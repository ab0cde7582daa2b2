"""The probes behind :func:`mixprec.emulate.fingerprint`, one function per step.

A :class:`Prober` places each probe (one dot product of exactly representable terms) on the diagonal of an
``(m, k) @ (k, n)`` call to ``fn`` and logs every batch with ``fn``'s answers. The steps, in the order
:func:`mixprec.emulate.fingerprints.fingerprint` runs them: :func:`scan_precision` (are products exact, the
effective precision, the alignment width), :func:`scan_rounding_and_group` (nearest or truncation, ``k_group``),
:func:`scan_promotion` (the promotion interval, split-K), :func:`build_model` (the :class:`MatmulModel` they
describe) and :func:`score_model` (the model against every logged probe and on random operands). Each step
issues the same calls of ``fn``, in the same batches, as the single function it was split from. The probes,
their assumptions and their limits are in docs/audit.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.core.formats import FORMAT_PRESETS, FloatFormat, get_format
from mixprec.emulate.matmul import MATMUL_PRESETS, MatmulModel, matmul

__all__ = [
    "BITS_SCAN",
    "MAX_GROUP",
    "Prober",
    "Scales",
    "build_model",
    "scan_precision",
    "scan_promotion",
    "scan_rounding_and_group",
    "score_model",
]

# Largest group size and promotion interval looked for; the g scan needs positions up to MAX_GROUP + 1 and a
# final -B beyond them, hence fingerprint's minimum k of 2 * MAX_GROUP.
MAX_GROUP = 256
# The effective-bits and alignment scans reach 2**-BITS_SCAN.
BITS_SCAN = 30

Term = tuple[int, float, float]  # (position in K, a value, b value): the product a * b at that position
Probe = list[Term]


class Prober:
    """Builds probes as exact products and runs them through ``fn`` (diagonal embedding) or through a model."""

    def __init__(
        self, fn: Callable[..., torch.Tensor], dtype: torch.dtype, device: torch.device, m: int, n: int, bar: Any
    ) -> None:
        self.fn, self.dtype, self.device, self.m, self.n, self.bar = fn, dtype, device, m, n, bar
        self.fmt = get_format(dtype)
        self.calls = 0
        self.log: list[tuple[int, list[Probe], torch.Tensor]] = []  # every probe batch and fn's answers

    def representable(self, x: float) -> bool:
        fmt = self.fmt
        if x == 0:
            return True
        if not math.isfinite(x) or abs(x) > fmt.max_finite:
            return False
        exponent = math.frexp(abs(x))[1] - 1
        spacing_exp = max(exponent, fmt.emin) - fmt.man_bits
        return math.ldexp(abs(x), -spacing_exp).is_integer()

    def term(self, pos: int, value: float) -> Term:
        """``value`` at ``pos`` as a product ``a * b`` of two representable numbers, ``b`` a power of two."""
        if value == 0:
            return (pos, 0.0, 0.0)
        exponent = math.frexp(value)[1]
        fmt = self.fmt
        for eb in sorted(range(fmt.emin - fmt.man_bits, fmt.emax + 1), key=lambda e: abs(2 * e - exponent)):
            a, b = math.ldexp(value, -eb), math.ldexp(1.0, eb)
            if self.representable(a) and self.representable(b):
                return (pos, a, b)
        raise RuntimeError(f"fingerprint: {value!r} is not a product of two {fmt.name} numbers (probe design bug)")

    def call(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        out = self.fn(a, b)
        self.calls += 1
        if self.bar is not None:
            self.bar.update(1)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            raise TypeError(f"fn must return a floating-point torch.Tensor; got {type(out).__name__}")
        if tuple(out.shape) != (a.shape[0], b.shape[1]):
            raise ValueError(f"fn(a, b) must return shape {(a.shape[0], b.shape[1])}; got {tuple(out.shape)}")
        return out

    def run(self, probes: Sequence[Probe], k: int) -> torch.Tensor:
        """fp64 results of ``fn`` on the probes (each a dot product of length ``k``)."""
        per_call = min(self.m, self.n)
        results = []
        for start in range(0, len(probes), per_call):
            chunk = probes[start : start + per_call]
            a = torch.zeros(self.m, k, dtype=torch.float64)
            b = torch.zeros(k, self.n, dtype=torch.float64)
            for i, terms in enumerate(chunk):
                for pos, x, y in terms:
                    a[i, pos] = x
                    b[pos, i] = y
            out = self.call(a.to(self.device, self.dtype), b.to(self.device, self.dtype))
            results.append(out.diagonal()[: len(chunk)].double().cpu())
        y = torch.cat(results)
        self.log.append((k, list(probes), y))
        return y


def _emulate_probes(probes: Sequence[Probe], k: int, model: MatmulModel) -> torch.Tensor:
    a = torch.zeros(len(probes), 1, k, dtype=torch.float64)
    b = torch.zeros(len(probes), k, 1, dtype=torch.float64)
    for i, terms in enumerate(probes):
        for pos, x, y in terms:
            a[i, 0, pos] = x
            b[i, pos, 0] = y
    return matmul(a, b, mode=model).reshape(-1).double()


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Elementwise equality of values, NaN equal to NaN ("bit-equal" here counts +0 and -0 as equal)."""
    return (x == y) | (x.isnan() & y.isnan())


def _first(flags: Sequence[bool], values: Sequence[int], want: bool) -> int | None:
    for flag, value in zip(flags, values):
        if flag == want:
            return value
    return None


def _acc_format(bits: int, inputs: FloatFormat) -> FloatFormat:
    """The accumulator format of ``bits`` precision: fp32, bf16, fp16 (for inputs with <= 5 exponent bits), else
    a format with fp32's exponent range (``tf32`` for 11 bits)."""
    if bits == 11 and inputs.exp_bits <= 5:
        return FORMAT_PRESETS["fp16"]
    return FloatFormat(8, bits - 1)


@dataclass(frozen=True)
class Scales:
    """The magnitudes every probe is built from: B = 1.5 * ``base`` (numbers just below B have B's spacing, so
    -B cancels B without finer rounding nearby), small addends B * 2**-j for 2 <= j <= ``j_max``, and ``last``,
    the final position of a length-k probe. B and every addend are products of two inputs."""

    base: float
    big: float
    last: int
    j_max: int

    @classmethod
    def of(cls, fin: FloatFormat, k: int) -> Scales:
        prod_max, prod_min = 2 * fin.emax, 2 * (fin.emin - fin.man_bits)
        b_exp = min(12, prod_max - 2)
        base = math.ldexp(1.0, b_exp)
        return cls(base=base, big=1.5 * base, last=k - 1, j_max=min(BITS_SCAN, b_exp - prod_min - 2))


def scan_precision(
    pr: Prober, s: Scales, k: int, out_emin: int, notes: list[str]
) -> tuple[bool, int | None, int | None]:
    """Steps 1-3, one batch: (products exact, effective bits or None, alignment width or None)."""
    t, fin, big, base = pr.term, pr.fmt, s.big, s.base
    # 1. products exact: -(1 + 2u') S then (1 + u')^2 S sum to 2**-(2p-2) S only if the product kept all its bits
    p = fin.precision
    h = max(0, math.ceil((out_emin + 2 * p - 2 + 2) / 2))
    x1 = math.ldexp(1.0 + math.ldexp(1.0, 1 - p), h)
    exact_probe = [t(0, -math.ldexp(1.0 + math.ldexp(1.0, 2 - p), 2 * h)), (1, x1, x1)]
    expected_exact = math.ldexp(1.0, 2 * h - (2 * p - 2))
    # 2. effective bits: is B + B 2**-j kept?  3. alignment: is B 2**-f kept after B - B inside one group?
    js = list(range(2, s.j_max + 1))
    q_probes = [[t(0, big), t(1, math.ldexp(base, -j)), t(s.last, -big)] for j in js]
    f_probes = [[t(0, big), t(1, -big), t(2, math.ldexp(base, -j))] for j in js]
    with torch.no_grad():
        y = pr.run([exact_probe, *q_probes, *f_probes], k)
    products_exact = bool(y[0] == expected_exact)
    if not products_exact:
        notes.append(f"products are rounded (the exact-product probe gave {y[0].item():g}, not {expected_exact:g})")
    kept = (y[1 : 1 + len(js)] != 0).tolist()
    lost_at = _first(kept, js, False)
    bits = lost_at  # B + B 2**-j is kept for j < bits: a precision of `bits` bits
    if bits is not None and any(kept[js.index(lost_at) :]):
        notes.append("a smaller addend was kept after a larger one was lost (not a fixed precision)")
    f_kept = (y[1 + len(js) :] != 0).tolist()
    f_lost = _first(f_kept, js, False)
    align = None if f_lost is None else f_lost - 1
    return products_exact, bits, align


def scan_rounding_and_group(
    pr: Prober, s: Scales, k: int, q: int, align: int | None, notes: list[str]
) -> tuple[str, int]:
    """Step 4, one batch: the rounding at precision ``q`` and the group size ``k_group``."""
    t, big, base = pr.term, s.big, s.base
    ulp = math.ldexp(base, 1 - q)
    r_probes = [[t(0, big), t(1, c * ulp), t(s.last, -big)] for c in (0.75, 0.25, 1.75)]
    gs = list(range(2, MAX_GROUP + 2))
    small_n = math.ldexp(base, -(q + 2))  # lost when added to B by the accumulator
    n_probes = [[t(0, big), t(1, small_n), t(j, -big)] for j in gs]
    resolve = [[t(0, small_n), t(2, big), t(3, -big)]]
    a_probes: list[Probe] = []
    if align is not None:
        small_a = math.ldexp(base, -(align + 2))  # lost inside an aligned group that holds B
        a_probes = [[t(0, big), t(1, -big), t(j, small_a)] for j in gs]
    with torch.no_grad():
        y = pr.run([*r_probes, *n_probes, *resolve, *a_probes], k)
    r75, r25, r175 = (y[i].item() for i in range(3))
    if r75 == ulp and r25 == 0 and r175 == 2 * ulp:
        rounding = "nearest"
    elif r75 == 0 and r25 == 0 and r175 == ulp:
        rounding = "toward_zero"
    else:
        rounding = "other"
        notes.append(f"rounding is neither nearest nor truncation (B + 0.75/0.25/1.75 ulp gave {r75}, {r25}, {r175})")
    n_kept = (y[3 : 3 + len(gs)] != 0).tolist()
    resolve_kept = bool(y[3 + len(gs)] != 0)
    if align is not None:
        a_kept = (y[4 + len(gs) :] != 0).tolist()
        g = _first(a_kept, gs, True)
        if g is None:
            notes.append(f"no group boundary up to {MAX_GROUP}: k_group set to {MAX_GROUP}")
            g = MAX_GROUP
        elif g == 2:
            g = 1
    else:
        g = _first(n_kept, gs, False)
        if g is None:
            notes.append(f"no group boundary up to {MAX_GROUP}: k_group set to {MAX_GROUP}")
            g = MAX_GROUP
        elif g == 2 and not resolve_kept:
            g = 1
    return rounding, g


def scan_promotion(
    pr: Prober, s: Scales, k: int, q: int, g: int, notes: list[str]
) -> tuple[int | None, int | None, int]:
    """Step 5, at k and 2 k: (promotion interval or None, split-K factor or None, k_group, set to 1 when the
    interval is not a multiple of it)."""
    t, big = pr.term, s.big
    # B at 0, c copies of d (one group apart) from t on, -B last. Each copy alone is lost on B in the
    # accumulator; c of them summed in a fresh block are kept when the block is added in fp32 (or, when the
    # accumulator is fp32, summed with -B in the last block), and c - 1 are not: the first t that shows
    # them is the first block boundary.
    d = 0.75 * math.ldexp(s.base, -q)
    copies = 1
    while copies * d <= math.ldexp(s.base, -24):
        copies += 1
    per_call = min(pr.m, pr.n)

    def promotion_scan(length: int) -> int | None:
        starts = list(range(g, length - 1 - copies * g, g))
        for first in range(0, len(starts), per_call):
            chunk = starts[first : first + per_call]
            probes = [[t(0, big), *(t(at + i * g, d) for i in range(copies)), t(length - 1, -big)] for at in chunk]
            with torch.no_grad():
                seen = (pr.run(probes, length) != 0).tolist()
            hit = _first(seen, chunk, True)
            if hit is not None:
                return hit
        return None

    p1 = promotion_scan(k)
    p2 = promotion_scan(2 * k)
    split_k = None
    if p1 is None and p2 is None:
        promote = None
    elif p1 == p2:
        promote = p1
    elif p1 is not None and p2 == 2 * p1:
        promote, split_k = p1, k // p1
    elif p1 is None:
        promote = None
        notes.append(f"a promotion interval of {p2} appeared only at k={2 * k}")
    else:
        promote = p1
        notes.append(f"promotion interval {p1} at k={k} but {p2} at k={2 * k}: neither fixed nor split-K")
    if promote is not None and promote % g:
        notes.append(f"promotion interval {promote} is not a multiple of k_group {g}: k_group set to 1")
        g = 1
    return promote, split_k, g


def build_model(
    fin: FloatFormat,
    out_fmt: FloatFormat | None,
    *,
    q: int,
    align: int | None,
    rounding: str,
    g: int,
    promote: int | None,
) -> tuple[MatmulModel, str | None, int | None]:
    """Step 6: (the model, the preset it equals or None, the alignment width it uses: 40 for a truncating
    accumulator without one, the aligned model with an (almost) exact group sum)."""
    if align is not None:
        accumulator = _acc_format(q, fin) if q < align + 1 else FORMAT_PRESETS["fp32"]
        align_rounding = "nearest" if rounding == "nearest" else "toward_zero"
    else:
        accumulator = _acc_format(min(q, 24), fin)
        align_rounding = "toward_zero"
        if rounding == "toward_zero":
            align = 40  # truncating accumulator: the aligned model with an (almost) exact group sum
    acc_bits = 24 if promote is not None else accumulator.precision
    output = out_fmt if out_fmt is not None and out_fmt.precision < acc_bits else None
    model = MatmulModel(
        inputs=fin,
        accumulator=accumulator,
        k_group=g,
        promote_every=promote,
        output=output,
        align_bits=align,
        align_rounding=align_rounding,
    )
    preset = _matching_preset(model)
    if preset is not None:
        model = dataclasses.replace(model, name=preset if output is None else f"{preset}+{output.name}-out")
    return model, preset, align


def score_model(pr: Prober, model: MatmulModel, k: int, seed: int) -> tuple[float, float, dict[str, float], str | None]:
    """Step 7: (bit-equal fraction on random operands, agreement on every logged probe, each preset's bit-equal
    fraction with the model's output rounding, the closest preset)."""
    agree = total = 0
    for length, probes, answers in pr.log:
        predicted = _emulate_probes(probes, length, model)
        agree += int(_same_bits(predicted, answers).sum())
        total += len(probes)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(pr.m, k, generator=gen, dtype=torch.float64).to(pr.dtype)
    b = torch.randn(k, pr.n, generator=gen, dtype=torch.float64).to(pr.dtype)
    with torch.no_grad():
        real = pr.call(a.to(pr.device), b.to(pr.device)).double().cpu()
    scores: dict[str, float] = {}
    bit_equal = _bit_equal(real, a, b, model)
    for name, candidate in MATMUL_PRESETS.items():
        if candidate.inputs == pr.fmt:
            scores[name] = _bit_equal(real, a, b, dataclasses.replace(candidate, output=model.output))
    closest = max(scores, key=lambda name: scores[name]) if scores else None
    return bit_equal, agree / total, scores, closest


def _bit_equal(real: torch.Tensor, a: torch.Tensor, b: torch.Tensor, model: MatmulModel) -> float:
    predicted = matmul(a.cpu(), b.cpu(), mode=model).double()
    return float(_same_bits(predicted, real).double().mean())


def _matching_preset(model: MatmulModel) -> str | None:
    """The preset equal to ``model`` apart from ``output`` (and the name), or None."""
    bare = dataclasses.replace(model, output=None)
    for name, preset in MATMUL_PRESETS.items():
        if dataclasses.replace(preset, output=None) == bare:
            return name
    return None
