"""Matrix products with a modelled accumulator: ``matmul``, the presets by name, and ``bounds``.

The model of one output element ``y = sum_k a_k b_k`` (:class:`MatmulModel`): the operands are rounded to
``inputs``; products are exact; the K products are summed in groups of ``k_group`` (one MMA instruction), each
group sum added to the running accumulator and rounded once to ``accumulator``; with ``promote_every=P`` that
accumulator is added into fp32 every P products and reset (the two-stage kernel of "Improving FP16/16 matmul
accuracy with two-stage accumulation", and DeepSeek-V3's promotion of fp8 GEMM partial sums); ``output`` rounds
the result. ``align_bits=F`` adds a tensor-core alignment model (Fasi et al. 2021; MMA-Sim, Xie et al. 2025).

``matmul`` is the user entry point; ``matmul_with_model`` is the same product for callers that already hold a
:class:`MatmulModel` (EmulatedLinear, ``mixprec.kernels``' CPU fallback). ``bounds`` gives Higham's deterministic
and Higham & Mary's probabilistic error bounds. On CPU tensors a compiled kernel (``mixprec.native``), on CUDA
tensors a Triton one (``mixprec.native.gpu``; models without alignment), computes the model with the same bits
as the torch code here, which stays as the fallback. The exactness argument of the
fp64 group sums, the kernel, the hardware comparison and the cost model are in ``docs/emulate.md``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

import mixprec.native as native
from mixprec.core.formats import FORMAT_PRESETS, FloatFormat, get_format
from mixprec.core.mx import MX_FORMATS, BlockFormat
from mixprec.core.rounding import round_to, round_to_
from mixprec.core.validate import check_choice, check_fraction, check_positive_float, check_positive_int, check_tensor
from mixprec.emulate._accumulate import _gamma, accumulate
from mixprec.native import gpu, kernels, ops

__all__ = [
    "MATMUL_PRESETS",
    "TENSOR_CORE_ALIGN_BITS",
    "ErrorBounds",
    "MatmulModel",
    "bounds",
    "get_matmul_model",
    "matmul",
    "matmul_with_model",
]

_ALIGN_ROUNDINGS = ("toward_zero", "nearest")

# Fraction bits kept after alignment to the largest exponent in one MMA (Fasi et al. 2021 for V100/A100; the
# H100 value and the fp8 one, which gives DeepSeek-V3's "about 14 bits" of fp8 accumulation, follow MMA-Sim).
TENSOR_CORE_ALIGN_BITS: dict[str, int] = {"v100": 23, "a100": 24, "h100": 25, "h100_fp8": 13}


@dataclass(frozen=True, kw_only=True)
class MatmulModel:
    """How an emulated matmul rounds (see the module docstring for the full model).

    Args:
        inputs: format the operands are rounded to (FloatFormat or preset name).
        accumulator: format of the (low-precision) running accumulator.
        k_group: products summed exactly before each accumulator rounding (one MMA's K), >= 1.
        promote_every: products between promotions of the accumulator into fp32, a multiple of ``k_group``;
            None = never (the whole K accumulates in ``accumulator``).
        output: format the result is rounded to; None = keep the accumulator's (fp32-held) value.
        align_bits: None, or F >= 1: the tensor-core alignment model with F fraction bits.
        align_rounding: rounding of each aligned group sum to ``accumulator``: "toward_zero" or "nearest".
        name: label for tables (not part of equality).
    """

    inputs: FloatFormat | str = "fp16"
    accumulator: FloatFormat | str = "fp16"
    k_group: int = 16
    promote_every: int | None = None
    output: FloatFormat | str | None = None
    align_bits: int | None = None
    align_rounding: str = "toward_zero"
    name: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", get_format(self.inputs, arg="inputs"))
        object.__setattr__(self, "accumulator", get_format(self.accumulator, arg="accumulator"))
        if self.output is not None:
            object.__setattr__(self, "output", get_format(self.output, arg="output"))
        check_positive_int("k_group", self.k_group)
        if self.promote_every is not None:
            check_positive_int("promote_every", self.promote_every)
            if self.promote_every % self.k_group:
                raise ValueError(
                    f"promote_every must be a multiple of k_group={self.k_group} (promotion happens between MMA "
                    f"instructions); got {self.promote_every}"
                )
        if self.align_bits is not None:
            check_positive_int("align_bits", self.align_bits)
            if self.align_bits > 40:
                raise ValueError(f"align_bits must be in 1..40 (fraction bits kept); got {self.align_bits}")
        check_choice("align_rounding", self.align_rounding, _ALIGN_ROUNDINGS)
        if not self.name:
            object.__setattr__(self, "name", self._describe())

    def _describe(self) -> str:
        text = f"{self.inputs.name}->{self.accumulator.name} k{self.k_group}"
        if self.promote_every is not None:
            text += f" promote{self.promote_every}"
        if self.align_bits is not None:
            text += f" align{self.align_bits}"
        if self.output is not None:
            text += f" out:{self.output.name}"
        return text


MATMUL_PRESETS: dict[str, MatmulModel] = {
    # cuBLAS-style fp16 GEMM accumulating in fp16 (m16n8k16 MMAs chained through an fp16 accumulator)
    "fp16/16": MatmulModel(inputs="fp16", accumulator="fp16", k_group=16, name="fp16/16"),
    # fp16 inputs, fp32 accumulation (the usual tensor-core GEMM)
    "fp16/32": MatmulModel(inputs="fp16", accumulator="fp32", k_group=16, name="fp16/32"),
    "bf16/32": MatmulModel(inputs="bf16", accumulator="fp32", k_group=16, name="bf16/32"),
    # fp16/32 with the Hopper alignment model (F=25, truncation): 95% of the outputs of cuBLAS's fp16 GEMM with fp32
    # output on an H200 bit-equal at M=N=K=1024 and 4096, where the exact-sum "fp16/32" has ~20x too small an error
    # (benchmarks/RESULTS.md, "Matmul accumulators on the H200")
    "fp16/32-h100": MatmulModel(
        inputs="fp16", accumulator="fp32", k_group=16, align_bits=TENSOR_CORE_ALIGN_BITS["h100"], name="fp16/32-h100"
    ),
    # two-stage kernel 3.2 (spatters/mma-matmul): each m16n8k16 MMA accumulates in fp16 from zero, then into fp32
    "two_stage": MatmulModel(inputs="fp16", accumulator="fp16", k_group=16, promote_every=16, name="two_stage"),
    # DeepSeek-V3: fp8 e4m3 WGMMA (K=32 per instruction) with ~14-bit accumulation, promoted every 128
    "fp8/promote128": MatmulModel(
        inputs="fp8_e4m3",
        accumulator="fp32",
        k_group=32,
        promote_every=128,
        align_bits=TENSOR_CORE_ALIGN_BITS["h100_fp8"],
        name="fp8/promote128",
    ),
    # the same without promotion: the whole K stays in the tensor core's limited accumulator
    "fp8/nopromote": MatmulModel(
        inputs="fp8_e4m3",
        accumulator="fp32",
        k_group=32,
        align_bits=TENSOR_CORE_ALIGN_BITS["h100_fp8"],
        name="fp8/nopromote",
    ),
}


def get_matmul_model(mode: MatmulModel | str, *, arg: str = "mode") -> MatmulModel:
    """A :class:`MatmulModel` from itself or a preset name (``MATMUL_PRESETS``)."""
    if isinstance(mode, MatmulModel):
        return mode
    if isinstance(mode, str):
        if mode in MATMUL_PRESETS:
            return MATMUL_PRESETS[mode]
        raise ValueError(f"{arg} must be a MatmulModel or one of {', '.join(map(repr, MATMUL_PRESETS))}; got {mode!r}")
    raise TypeError(f"{arg} must be a MatmulModel or a preset name; got {type(mode).__name__} {mode!r}")


# ---------------------------------------------------------------------------------------------- the kernel
_OPERAND_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)


class _Unset:
    def __repr__(self) -> str:
        return "<from mode>"


_UNSET: Any = _Unset()


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    mode: MatmulModel | str | None = None,
    inputs: FloatFormat | str = _UNSET,
    accumulator: FloatFormat | str = _UNSET,
    k_group: int = _UNSET,
    promote_every: int | None = _UNSET,
    output: FloatFormat | str | None = _UNSET,
    align_bits: int | None = _UNSET,
    align_rounding: str = _UNSET,
) -> torch.Tensor:
    """``a @ b`` with the accumulation model of :class:`MatmulModel`; returns fp32 (values exact in the model).

    Args:
        a: ``(..., M, K)``, b: ``(..., K, N)``, batch dims broadcast as in ``torch.matmul`` (both >= 2-D). Any
            float dtype; fp64 operands are rounded to ``inputs`` directly.
        mode: a preset name (``MATMUL_PRESETS``: "fp16/16", "fp16/32", "bf16/32", "fp16/32-h100", "two_stage",
            "fp8/promote128", "fp8/nopromote") or a MatmulModel; None = ``MatmulModel()`` (fp16 in, fp16
            accumulator, k_group 16). The keyword fields below override the mode's.
        inputs, accumulator, k_group, promote_every, output, align_bits, align_rounding: see MatmulModel.

    Error: :func:`bounds` gives deterministic and probabilistic bounds on ``|y - a_r @ b_r|`` relative to
    ``|a_r| @ |b_r|`` (``a_r``, ``b_r`` the rounded operands).

    Block-scaled inputs: ``inputs`` a block format (``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``,
    ``"mxfp6_e3m2"``, ``"mxfp4_e2m1"``, ``"nvfp4"``) quantizes ``a`` along K (its last dim) and ``b`` along K (dim
    -2) with :func:`mixprec.emulate.mx_quantize` (default scale mode) and sums the block products with
    ``accumulator``: ``"fp32"`` (the default), ``"fp8/promote128"`` (Hopper), ``"blackwell"`` or a MatmulModel
    (:func:`mixprec.emulate.mx_matmul.block_scaled_matmul`); ``mode`` and the other fields must be left unset.

    Autograd: not recorded (the result has no ``grad_fn``). An operand that requires grad while grad mode is on
    raises ValueError rather than silently cutting the graph: use :class:`mixprec.emulate.EmulatedLinear` (or
    ``emulate_linear_layers``), whose backward products are emulated too, or pass ``.detach()``-ed operands.
    """
    if isinstance(inputs, BlockFormat) or (isinstance(inputs, str) and inputs in MX_FORMATS):
        fields = {"k_group": k_group, "promote_every": promote_every, "output": output, "align_bits": align_bits}
        given = ["mode"] if mode is not None else []
        given += [k for k, v in {**fields, "align_rounding": align_rounding}.items() if v is not _UNSET]
        return _block_scaled(a, b, inputs, accumulator, given)
    for name, t in (("a", a), ("b", b)):
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name} requires grad, but emulate.matmul records no autograd graph: use EmulatedLinear / "
                "emulate_linear_layers for gradients through emulated matmuls, or pass "
                f"{name}.detach() (or call under torch.no_grad())"
            )
    overrides = {
        k: v
        for k, v in {
            "inputs": inputs,
            "accumulator": accumulator,
            "k_group": k_group,
            "promote_every": promote_every,
            "output": output,
            "align_bits": align_bits,
            "align_rounding": align_rounding,
        }.items()
        if v is not _UNSET
    }
    if mode is None:
        model = MatmulModel(**overrides)
    else:
        model = get_matmul_model(mode)
        if overrides:
            model = dataclasses.replace(model, name="", **overrides)
    return matmul_with_model(a, b, model)


def _block_scaled(
    a: torch.Tensor, b: torch.Tensor, inputs: BlockFormat | str, accumulator: object, given: list[str]
) -> torch.Tensor:
    """:func:`matmul` with block-scaled ``inputs``; ``given``: the other fields the caller set (refused)."""
    if given:
        raise ValueError(
            f"{', '.join(given)}: not used with block-scaled inputs={inputs!r}; pass the accumulator model as "
            "accumulator= (a name or a MatmulModel)"
        )
    from mixprec.emulate.mx_matmul import block_scaled_matmul  # mx_matmul builds on this module

    return block_scaled_matmul(a, b, inputs, "fp32" if accumulator is _UNSET else accumulator)


def _check_operand(x: object, name: str) -> torch.Tensor:
    check_tensor(name, x, _OPERAND_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"{name} must be at least 2-D (..., rows, cols); got shape {tuple(x.shape)}")
    return x


def matmul_with_model(a: torch.Tensor, b: torch.Tensor, model: MatmulModel, *, rounded: bool = False) -> torch.Tensor:
    """Validate, round the operands to ``model.inputs`` (skipped when the caller passes ``rounded=True``
    operands that already hold representable values, e.g. EmulatedLinear's saved ones), broadcast, accumulate."""
    _check_operand(a, "a")
    _check_operand(b, "b")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device; got {a.device} and {b.device}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a (..., M, K) and b (..., K, N) must agree on K; got {tuple(a.shape)} and {tuple(b.shape)}")
    try:
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError as exc:
        raise ValueError(f"batch dims of a {tuple(a.shape)} and b {tuple(b.shape)} do not broadcast") from exc
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    with torch.autocast(device_type=a.device.type, enabled=False), torch.no_grad():
        nbatch = math.prod(batch)
        if _gpu_ok(a, b, model, nbatch * m * n * k):
            ar, br = _native_operands(a, b, model, rounded)
            y = _gpu_accumulate(ar, br, batch, model)
            if model.output is not None:
                round_to_(y, model.output)
            return y
        path = _native_path(a, b, model, nbatch * m * n * k)
        if path is not None:
            ar, br = _native_operands(a, b, model, rounded)
            y = _native_accumulate(path, ar, br, batch, model)
            if y is not None:
                if model.output is not None:
                    round_to_(y, model.output)
                return y
        ar = a.double() if rounded else round_to(a, model.inputs).double()
        br = b.double() if rounded else round_to(b, model.inputs).double()
        # explicit sizes, not -1: with K = 0 a reshape cannot infer the other dimension
        if math.prod(b.shape[:-2]) == 1:
            # b is shared by the whole batch: fold the batch into rows (one big product, no copies of b)
            a3 = ar.expand(*batch, m, k).reshape(1, nbatch * m, k)
            b3 = br.reshape(1, k, n)
        else:
            a3 = ar.expand(*batch, m, k).reshape(nbatch, m, k)
            b3 = br.expand(*batch, k, n).reshape(nbatch, k, n)
        y = accumulate(a3, b3, model)
        if model.output is not None:
            round_to_(y, model.output)
        return y.reshape(*batch, m, n)


# ---------------------------------------------------------------------------------------------- compiled path
_ROUND_FP32, _ROUND_FP16, _ROUND_GENERIC = 0, 1, 2


def _native_path(a: torch.Tensor, b: torch.Tensor, model: MatmulModel, work: int) -> str | None:
    """How the compiled kernel runs this product (:func:`mixprec.native.route`: "kernel" or "op"), or None: only
    CPU, no alignment model, non-empty (and a k_group that fits the kernel's C int)."""
    if model.align_bits is not None or work == 0 or model.k_group >= 1 << 30:
        return None
    return native.route(a, b)


def _native_operands(
    a: torch.Tensor, b: torch.Tensor, model: MatmulModel, rounded: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` rounded to ``model.inputs``, held in fp16/bf16 when that is the format (half the bytes to
    pack), else in fp32 (which holds every input format). torch's cast to fp16/bf16 from fp32/fp16/bf16 is
    bit-exact with :func:`round_to` (core/rounding.py's contract) and exact on already-rounded operands; fp64
    operands are rounded once by :func:`round_to` (torch's fp64 casts round twice)."""
    dtype = model.inputs.torch_dtype
    if dtype in (torch.float16, torch.bfloat16) and (rounded or torch.float64 not in (a.dtype, b.dtype)):
        return a.to(dtype), b.to(dtype)
    if rounded:
        return a.float(), b.float()
    return round_to(a, model.inputs), round_to(b, model.inputs)


def _gpu_ok(a: torch.Tensor, b: torch.Tensor, model: MatmulModel, work: int) -> bool:
    """The Triton kernel can run this product: CUDA, no alignment model, a K group it holds in registers."""
    return gpu.can_run(a, b) and model.align_bits is None and work > 0 and model.k_group <= gpu.MAX_K_GROUP


def _batched(ar: torch.Tensor, br: torch.Tensor, batch: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, M, K)`` and ``(B or 1, K, N)`` views of the broadcast operands; a ``b`` shared by the batch
    is folded into one product with the batch as rows (no copies of ``b``)."""
    m, k, n = ar.shape[-2], ar.shape[-1], br.shape[-1]
    nbatch = math.prod(batch)
    if math.prod(br.shape[:-2]) == 1:
        return ar.expand(*batch, m, k).reshape(nbatch * m, k).unsqueeze(0), br.reshape(k, n).unsqueeze(0)
    return ar.expand(*batch, m, k).reshape(nbatch, m, k), br.expand(*batch, k, n).reshape(nbatch, k, n)


def _promotion_groups(model: MatmulModel, k: int) -> int:
    """Groups per promotion into fp32 (0: none); one at or above the group count promotes once, at the end."""
    groups = -(-k // model.k_group)
    return 0 if model.promote_every is None else min(model.promote_every // model.k_group, groups)


def _overflow_value(fmt: FloatFormat) -> float:
    return fmt.max_finite if fmt.saturate else (math.inf if fmt.has_inf else math.nan)


def _gpu_accumulate(ar: torch.Tensor, br: torch.Tensor, batch: torch.Size, model: MatmulModel) -> torch.Tensor:
    """The model's product on the Triton kernel (:mod:`mixprec.native.gpu`), same bits as the compiled one."""
    m, n = ar.shape[-2], br.shape[-1]
    a3, b3 = _batched(ar, br, batch)
    acc = model.accumulator
    mode = 0 if acc.is_fp32 else _ROUND_GENERIC
    pg = _promotion_groups(model, a3.shape[-1])
    out = gpu.matmul_model(a3, b3, model.k_group, pg, mode, acc, _overflow_value(acc))
    return out.reshape(*batch, m, n)


def _native_accumulate(
    path: str, ar: torch.Tensor, br: torch.Tensor, batch: torch.Size, model: MatmulModel
) -> torch.Tensor | None:
    """The model's product on the compiled kernel (fp32, fp16 or bf16 operands holding input-format values); None
    when the kernel could not allocate its buffers (the torch path then runs)."""
    m, k, n = ar.shape[-2], ar.shape[-1], br.shape[-1]
    a3, b3 = _batched(ar, br, batch)
    acc = model.accumulator
    if acc.is_fp32:
        mode = _ROUND_FP32
    elif acc == FORMAT_PRESETS["fp16"]:
        mode = _ROUND_FP16
    else:
        mode = _ROUND_GENERIC
    fmt = (acc.man_bits, acc.emin, acc.emax, acc.max_finite, _overflow_value(acc), acc.min_normal, acc.subnormals)
    pg = _promotion_groups(model, k)
    if path == "op":
        return ops.matmul_model(a3, b3, model.k_group, pg, mode, fmt).reshape(*batch, m, n)
    out = torch.empty(a3.shape[0], a3.shape[1], n, dtype=torch.float32)
    if not kernels.matmul_model(a3, b3, out, model.k_group, pg, mode, fmt):
        return None
    return out.reshape(*batch, m, n)


# ---------------------------------------------------------------------------------------------- error bounds
@dataclass(frozen=True)
class ErrorBounds:
    """Forward-error bounds of one emulated dot product of length ``k``, relative to ``sum_i |a_i b_i|``.

    ``deterministic``: worst case (Higham's gamma_n = n u / (1 - n u) per chain of roundings, composed).
    ``probabilistic``: Higham & Mary (2019, SIAM J. Sci. Comput. 41(5), Thm 3.1) with
    ``gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1``; holds with probability at least ``probability``
    under their model of independent mean-zero rounding errors. None where the model rounds toward zero (biased
    errors: no sqrt(n) law).
    """

    k: int
    model: str
    n_accumulator_roundings: int
    accumulator_unit_roundoff: float
    n_fp32_roundings: int
    deterministic: float
    probabilistic: float | None
    lam: float
    probability: float | None


def _gamma_prob(n: int, u: float, lam: float) -> float:
    return math.expm1(lam * math.sqrt(n) * u + n * u * u / (1 - u)) if n else 0.0


def bounds(
    k: int, mode: MatmulModel | str, *, confidence: float | None = None, lam: float | None = None
) -> ErrorBounds:
    """Error bounds of ``matmul`` with ``mode`` on dot products of length ``k``, as multiples of ``sum|a_i b_i|``
    over the rounded operands (input rounding is not included: it is the same for every accumulator).

    Model: the low-precision chain makes ``n1 = ceil(min(k, P) / k_group)`` roundings of unit roundoff ``u1``
    (``P`` = promote_every or k); with alignment each step also truncates ``k_group + 1`` aligned terms by less
    than ``2**-F`` of the largest, so ``u1 = u_acc + (k_group + 1) 2**-F``, with ``u_acc = 2**-man_bits`` for
    toward_zero. Promotion adds ``n2 = ceil(k / P)`` fp32 roundings (``u = 2**-24``); ``output`` one more.
    Deterministic: ``(1 + gamma_n1(u1)) (1 + gamma_n2(u32)) (1 + u_out) - 1``.

    Probabilistic (one output element): the same product with ``gamma~_n(lam)``; it holds with probability at least
    ``1 - 2 (n1 + n2) exp(-lam^2 (1 - u1)^2 / 2)`` (Higham & Mary's ``Q(lam, n)``, a union over both chains).

    Args:
        k: dot-product length, int >= 1.
        mode: a preset name or MatmulModel.
        confidence: probability in (0, 1) that the probabilistic bound holds for one output element; ``lam`` is
            solved from it: ``lam = sqrt(2 ln(2 (n1 + n2) / (1 - confidence))) / (1 - u1)``. For all of ``m``
            outputs at once, pass ``1 - (1 - c) / m`` (union bound). Default 0.99 when ``lam`` is not given.
        lam: the bound's ``lambda`` directly (> 0); ``probability`` then says how likely the bound holds (0 when
            lam is too small for any guarantee). Give ``confidence`` or ``lam``, not both.

    Raises:
        TypeError: ``k``, ``confidence`` or ``lam`` of the wrong type; ValueError: out of range, or both given.
    """
    check_positive_int("k", k)
    if confidence is not None and lam is not None:
        raise ValueError(f"give confidence or lam, not both; got confidence={confidence!r}, lam={lam!r}")
    if lam is not None:
        lam = check_positive_float("lam", lam)
    else:
        confidence = 0.99 if confidence is None else check_fraction("confidence", confidence)
    model = get_matmul_model(mode)
    acc = model.accumulator
    chain = k if model.promote_every is None else min(k, model.promote_every)
    n1 = -(-chain // model.k_group)
    biased = model.align_bits is not None and model.align_rounding == "toward_zero"
    u1 = acc.eps if biased else acc.unit_roundoff
    if model.align_bits is not None:
        u1 += (model.k_group + 1) * 2.0 ** (-model.align_bits)
    n2 = 0 if model.promote_every is None else -(-k // model.promote_every)
    u32 = FORMAT_PRESETS["fp32"].unit_roundoff
    u_out = 0.0 if model.output is None else model.output.unit_roundoff
    det = (1 + _gamma(n1, u1)) * (1 + _gamma(n2, u32)) * (1 + u_out) - 1
    if lam is None:
        assumed = 1.0 - float(confidence)  # failure probability 2 (n1 + n2) exp(-lam^2 (1 - u1)^2 / 2) = 1 - conf
        lam = math.sqrt(2 * math.log(2 * (n1 + n2) / assumed)) / (1 - u1)
    prob: float | None = None
    probability: float | None = None
    if not biased:
        prob = (1 + _gamma_prob(n1, u1, lam)) * (1 + _gamma_prob(n2, u32, lam)) * (1 + u_out) - 1
        # Q(lam, n) = 1 - n (1 - P(lam)), P(lam) = 1 - 2 exp(-lam^2 (1 - u)^2 / 2), union over both chains
        fail = 2 * (n1 + n2) * math.exp(-(lam**2) * (1 - u1) ** 2 / 2)
        probability = max(0.0, 1.0 - fail)
    return ErrorBounds(
        k=k,
        model=model.name,
        n_accumulator_roundings=n1,
        accumulator_unit_roundoff=u1,
        n_fp32_roundings=n2,
        deterministic=det,
        probabilistic=prob,
        lam=float(lam),
        probability=probability,
    )
