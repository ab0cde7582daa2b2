"""Independent scalar references for the emulation tests: exact rational arithmetic (fractions), one value at a
time. Slow by design and written without any of the library's bit tricks, so that agreement means something."""

from __future__ import annotations

import math
from fractions import Fraction

from mixprec.emulate import FloatFormat


def _floor_log2(mag: Fraction) -> int:
    k = mag.numerator.bit_length() - mag.denominator.bit_length()
    while Fraction(2) ** k > mag:
        k -= 1
    while Fraction(2) ** (k + 1) <= mag:
        k += 1
    return k


def ref_round(x: float | Fraction, fmt: FloatFormat, mode: str = "nearest") -> float:
    """Round ``x`` (a Python float, i.e. an exact fp64 value, or an exact Fraction) to ``fmt``: "nearest"
    (ties to even) or "toward_zero"."""
    if isinstance(x, Fraction):
        if x == 0:
            return 0.0
        return _round_finite(-1.0 if x < 0 else 1.0, abs(x), fmt, mode)
    if math.isnan(x):
        return math.nan
    if math.isinf(x):
        if fmt.saturate:
            return math.copysign(fmt.max_finite, x)
        return x if fmt.has_inf else math.nan
    if x == 0:
        return x
    return _round_finite(-1.0 if x < 0 else 1.0, Fraction(abs(x)), fmt, mode)


def _round_finite(sign: float, mag: Fraction, fmt: FloatFormat, mode: str) -> float:
    e = max(_floor_log2(mag), fmt.emin)
    spacing = Fraction(2) ** (e - fmt.man_bits)
    n = mag / spacing
    whole = math.floor(n)
    rest = n - whole
    if mode == "nearest" and (rest > Fraction(1, 2) or (rest == Fraction(1, 2) and whole % 2 == 1)):
        whole += 1
    r = whole * spacing
    if r > Fraction(fmt.max_finite):
        if mode == "toward_zero" or fmt.saturate:
            return sign * fmt.max_finite
        return sign * math.inf if fmt.has_inf else math.nan
    if not fmt.subnormals and 0 < r < Fraction(fmt.min_normal):
        return sign * 0.0
    return sign * float(r)


def ref_neighbours(x: float, fmt: FloatFormat) -> tuple[float, float]:
    """The representable values just below/at and just above ``|x|`` (sign of x), without overflow handling."""
    sign = -1.0 if x < 0 else 1.0
    mag = Fraction(abs(x))
    e = max(_floor_log2(mag), fmt.emin)
    spacing = Fraction(2) ** (e - fmt.man_bits)
    whole = math.floor(mag / spacing)
    return sign * float(whole * spacing), sign * float((whole + 1) * spacing)


def ref_matmul_element(
    a_row: list[float],
    b_col: list[float],
    *,
    acc: FloatFormat,
    k_group: int,
    promote_every: int | None,
    align_bits: int | None = None,
    align_rounding: str = "toward_zero",
) -> float:
    """One output element of the accumulation model, exactly: operands already rounded to the input format."""
    fp32 = FloatFormat(8, 23)
    products = [Fraction(x) * Fraction(y) for x, y in zip(a_row, b_col)]
    while len(products) % k_group:
        products.append(Fraction(0))
    low = 0.0
    promoted = 0.0
    n_groups = len(products) // k_group
    for g in range(n_groups):
        group = products[g * k_group : (g + 1) * k_group]
        if align_bits is None:
            low = ref_round(Fraction(low) + sum(group), acc)
        else:
            terms = [Fraction(low), *group]
            nonzero = [abs(t) for t in terms if t != 0]
            if nonzero:
                spacing = Fraction(2) ** (_floor_log2(max(nonzero)) - align_bits)
                total = sum(math.trunc(t / spacing) * spacing for t in terms)
                low = ref_round(total, acc, align_rounding) if total != 0 else 0.0
            else:
                low = 0.0
        if promote_every is not None and ((g + 1) % (promote_every // k_group) == 0 or g == n_groups - 1):
            promoted = ref_round(Fraction(promoted) + Fraction(low), fp32)
            low = 0.0
    return promoted if promote_every is not None else low
