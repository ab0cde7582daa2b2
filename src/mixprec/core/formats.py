"""Floating-point formats to emulate: ``FloatFormat`` and the presets by name.

A format has 1 sign bit, ``exp_bits`` exponent bits and ``man_bits`` stored fraction bits (precision
``p = man_bits + 1``). Every value of every supported format is exactly representable in fp32, which is what
lets the emulator hold rounded values in fp32 tensors: hence ``exp_bits <= 8`` and ``man_bits <= 23``.
``has_inf=True`` is IEEE 754's top-exponent convention (inf and NaN); ``has_inf=False`` is the "fn" one of fp8
e4m3fn (finite values up to 448, only the all-ones pattern is NaN). ``saturate`` sends overflow to +-max.
The two conventions' largest finite values are worked out in ``docs/emulate.md``.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

import torch

__all__ = ["FORMAT_PRESETS", "FloatFormat", "get_format"]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: ``FloatFormat(exp_bits, man_bits, *, has_inf, saturate, subnormals)``.

    Args:
        exp_bits: exponent bits, 2..8 (8 only with ``has_inf=True``: the values must fit in fp32).
        man_bits: stored fraction bits, 1..23 (precision is ``man_bits + 1`` bits).
        has_inf: IEEE inf/NaN encoding in the top exponent (True) or the "fn" convention (False: no inf, the
            top exponent holds finite values, only its all-ones fraction is NaN).
        saturate: overflow goes to +-max (True) instead of +-inf (or NaN when ``has_inf=False``).
        subnormals: keep gradual underflow (True); False flushes results below the smallest normal to a zero
            of the same sign (tininess detected after rounding).
        name: a label for tables (not part of equality).
    """

    exp_bits: int
    man_bits: int
    _: KW_ONLY
    has_inf: bool = True
    saturate: bool = False
    subnormals: bool = True
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for arg in ("exp_bits", "man_bits"):
            v = getattr(self, arg)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"FloatFormat: {arg} must be an int; got {type(v).__name__} {v!r}")
        if not 2 <= self.exp_bits <= 8:
            raise ValueError(f"FloatFormat: exp_bits must be in 2..8 (values are held in fp32); got {self.exp_bits}")
        if not 1 <= self.man_bits <= 23:
            raise ValueError(f"FloatFormat: man_bits must be in 1..23 (values are held in fp32); got {self.man_bits}")
        for arg in ("has_inf", "saturate", "subnormals"):
            if not isinstance(getattr(self, arg), bool):
                raise TypeError(f"FloatFormat: {arg} must be a bool; got {getattr(self, arg)!r}")
        if self.exp_bits == 8 and not self.has_inf:
            raise ValueError(
                "FloatFormat: exp_bits=8 requires has_inf=True (an 'fn' format with 8 exponent bits reaches 2**129, "
                "beyond fp32, which holds the emulated values)"
            )
        if not self.name:
            object.__setattr__(self, "name", self._default_name())

    def _default_name(self) -> str:
        for preset_name, preset in FORMAT_PRESETS.items():
            if preset == self:
                return preset_name
        flags = "" if self.has_inf else "fn"
        flags += "" if not self.saturate else "_sat"
        flags += "" if self.subnormals else "_ftz"
        return f"e{self.exp_bits}m{self.man_bits}{flags}"

    # ------------------------------------------------------------------ derived constants (all exact)
    @property
    def bias(self) -> int:
        return 2 ** (self.exp_bits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value, ``1 - bias``."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return self.bias if self.has_inf else 2**self.exp_bits - 1 - self.bias

    @property
    def max_finite(self) -> float:
        frac = 2.0 - 2.0 ** (-self.man_bits) if self.has_inf else 2.0 - 2.0 ** (1 - self.man_bits)
        return math.ldexp(frac, self.emax)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.emin - self.man_bits)

    @property
    def precision(self) -> int:
        """Significand bits including the implicit bit."""
        return self.man_bits + 1

    @property
    def unit_roundoff(self) -> float:
        """``u = 2**-p``: the relative error bound of round to nearest in the normal range."""
        return math.ldexp(1.0, -self.precision)

    @property
    def eps(self) -> float:
        """Machine epsilon ``2**-man_bits`` (distance from 1 to the next value; the bound for toward_zero)."""
        return math.ldexp(1.0, -self.man_bits)

    @property
    def is_fp32(self) -> bool:
        """True for fp32 itself (rounding an fp32 value to it is the identity)."""
        return self == FORMAT_PRESETS["fp32"]

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype with exactly this format and overflow behaviour of torch's cast, else None."""
        for preset_name, dtype in _TORCH_DTYPES.items():
            if FORMAT_PRESETS[preset_name] == self:
                return dtype
        return None

    def __str__(self) -> str:
        return self.name


# torch 2.13's float8_e4m3fn cast saturates: every finite overflow and +-inf becomes +-448 (measured; older
# torch returned NaN for values >= 480). The preset follows the cast so that round_to is bit-exact with it;
# FloatFormat(4, 3, has_inf=False) without saturate gives the NaN-on-overflow variant of the OCP spec.
FORMAT_PRESETS: dict[str, FloatFormat] = {
    "fp32": FloatFormat(8, 23, name="fp32"),
    "tf32": FloatFormat(8, 10, name="tf32"),
    "fp16": FloatFormat(5, 10, name="fp16"),
    "bf16": FloatFormat(8, 7, name="bf16"),
    "fp8_e4m3": FloatFormat(4, 3, has_inf=False, saturate=True, name="fp8_e4m3"),
    "fp8_e5m2": FloatFormat(5, 2, name="fp8_e5m2"),
}

_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "e4m3": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
}


def get_format(fmt: FloatFormat | str | torch.dtype, *, arg: str = "fmt") -> FloatFormat:
    """A :class:`FloatFormat` from itself, a preset name (``FORMAT_PRESETS``) or a torch dtype that has one."""
    if isinstance(fmt, FloatFormat):
        return fmt
    if isinstance(fmt, str):
        key = _ALIASES.get(fmt, fmt)
        if key in FORMAT_PRESETS:
            return FORMAT_PRESETS[key]
        raise ValueError(f"{arg} must be a FloatFormat or one of {', '.join(map(repr, FORMAT_PRESETS))}; got {fmt!r}")
    if isinstance(fmt, torch.dtype):
        for preset_name, dtype in _TORCH_DTYPES.items():
            if dtype == fmt:
                return FORMAT_PRESETS[preset_name]
        raise ValueError(
            f"{arg}: torch dtype {fmt} has no emulated format; use one of {', '.join(map(str, _TORCH_DTYPES.values()))}"
        )
    raise TypeError(f"{arg} must be a FloatFormat, a preset name or a torch dtype; got {type(fmt).__name__} {fmt!r}")
