"""mx_quantize bit for bit against the packages it claims to match: torchao's reference quantizers (``to_mx`` /
``to_dtype``, ``nvfp4_quantize``, run on the CPU) and ml_dtypes' element casts. Optional test dependencies
(``pip install torchao==0.18.0 ml_dtypes==0.6.0``): skipped when absent.

Where torchao differs, the difference is asserted to be exactly the one docs/mx.md describes: its division by
2**-126 in blocks whose E8M0 scale is 2**-127, and its fp32 ``log2`` in ``rceil``.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from mixprec.core.mx import round_elements
from mixprec.emulate import MX_FORMATS, mx_quantize
from test_mx import ELEMENTS, blocks_of_every_kind

TORCHAO_MODES = ("floor", "ceil", "even", "rceil")


@pytest.fixture(scope="module")
def ao():
    """torchao's MX modules (imported once; its import logs deprecation warnings of torch's pytree)."""
    pytest.importorskip("torchao")
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
    from torchao.prototype.mx_formats import config, constants, kernels, mx_tensor, nvfp4_tensor

    return {"config": config, "constants": constants, "kernels": kernels, "mx": mx_tensor, "nvfp4": nvfp4_tensor}


def torchao_elem_dtype(ao: dict, fmt: str) -> object:
    c = ao["constants"]
    return {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp6_e2m3": c.DTYPE_FP6_E2M3,
        "mxfp6_e3m2": c.DTYPE_FP6_E3M2,
        "mxfp4_e2m1": torch.float4_e2m1fn_x2,
    }[fmt]


def torchao_elements(ao: dict, fmt: str, data: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """torchao's element codes decoded to fp32 by its own decoders."""
    k = ao["kernels"]
    if fmt.startswith("mxfp8"):
        return data.float().view(shape)
    if fmt == "mxfp6_e2m3":
        return k.f6_e2m3_unpacked_to_f32(data).view(shape)
    if fmt == "mxfp6_e3m2":
        return k.f6_e3m2_unpacked_to_f32(data).view(shape)
    return k.f4_unpacked_to_f32(k.unpack_uint4(data.view(torch.uint8).contiguous())).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal fp32 bit patterns, or both NaN."""
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())


def data(fmt: str, block: int) -> torch.Tensor:
    """Every kind of block (test_mx.blocks_of_every_kind) plus a larger random normal / heavy-tailed batch."""
    g = torch.Generator().manual_seed(11)
    bulk = torch.randn(256, block, generator=g) * torch.exp(torch.randn(256, 1, generator=g) * 3)
    return torch.cat([blocks_of_every_kind(fmt, block), bulk])


@pytest.mark.parametrize("fmt", [f for f, b in MX_FORMATS.items() if b.scale == "e8m0"])
@pytest.mark.parametrize("mode", TORCHAO_MODES)
def test_mx_formats_match_torchao(ao: dict, fmt: str, mode: str) -> None:
    x = data(fmt, 32)
    scale_ao, data_ao = ao["mx"].to_mx(x, torchao_elem_dtype(ao, fmt), 32, ao["config"].ScaleCalculationMode(mode))
    deq_ao = ao["mx"].to_dtype(data_ao, scale_ao, torchao_elem_dtype(ao, fmt), 32, torch.float32)
    elems_ao = torchao_elements(ao, fmt, data_ao, x.shape)
    scales_ao = scale_ao.float().view(-1)  # E8M0 decoded by torch's cast (255 -> NaN)

    q = mx_quantize(x, fmt, scale_mode=mode)
    scales = q.scales.view(-1)
    nan_block = scales.isnan()
    same_scale = same_bits(scales, scales_ao)
    same_elems = same_bits(q.elements, elems_ao).all(1) | nan_block  # a NaN block's elements are not defined
    same_deq = same_bits(q.dequantize(), deq_ao).all(1)

    # 1. torchao divides by 2**-126 where it stores the scale 2**-127 (pytorch/pytorch#125557 workaround):
    #    there its elements are ours for the divisor 2**-126, and its own to_dtype is off by a factor 2.
    bottom = (scales == 2.0**-127) & (x != 0).any(1)
    if mode != "rceil":
        assert bool((same_scale | nan_block).all())
        expect = round_elements(x[bottom] * 2.0**126, fmt)
        assert bool(same_bits(elems_ao[bottom], expect).all())
        assert bool((same_elems | bottom).all()) and bool((same_deq | bottom).all())
        assert bool(bottom.any()) and bool((~same_elems).any())  # the data reaches the case
        return
    # 2. rceil: torchao's eager path takes ceil(log2(d)) of an fp32 log2, which rounds to the integer below when
    #    d = fp32(amax / max) lies just above a power of two; ours is the exact ceil of cvt.rp.ue8m0 (cuBLAS).
    #    There torchao's scale is half of ours and its elements are ours for its scale.
    bottom_ao = bottom & (scales_ao == 2.0**-127)
    differ = ~same_scale & ~nan_block
    assert bool(differ.any())  # the data reaches the case
    assert bool(torch.equal(scales_ao[differ] * 2, scales[differ]))
    d = (x[differ].abs().amax(1) / MX_FORMATS[fmt].max_element).double()
    assert bool(((d / scales_ao[differ].double() - 1) < 2.0**-15).all()) and bool((d > scales_ao[differ]).all())
    expect = round_elements(x[differ] / scales_ao[differ, None], fmt)
    assert bool(same_bits(elems_ao[differ], expect).all())
    assert bool((same_elems | differ).all()) and bool((same_deq | differ | bottom_ao).all())


@pytest.mark.parametrize("two_level", [False, True])
def test_nvfp4_matches_torchao(ao: dict, two_level: bool) -> None:
    x = data("nvfp4", 16)
    k, nv = ao["kernels"], ao["nvfp4"]
    for amax in (1e4, 1.0, 1e-30):
        ts = nv.per_tensor_amax_to_scale(torch.tensor(amax)) if two_level else None
        scale_ao, data_ao = nv.nvfp4_quantize(x, 16, ts)
        elems_ao = k.f4_unpacked_to_f32(k.unpack_uint4(data_ao)).view(x.shape)
        q = mx_quantize(x, "nvfp4", tensor_scale=ts)
        assert bool(same_bits(q.scales.view(-1), scale_ao.float().view(-1)).all())
        nan_block = q.scales.view(-1).isnan()
        assert bool((same_bits(q.elements, elems_ao).all(1) | nan_block).all())
        t = nv.NVFP4Tensor(data_ao, scale_ao, 16, torch.float32, per_tensor_scale=ts)
        assert bool(same_bits(q.dequantize(), t.dequantize(torch.float32)).all())


def test_bf16_input_matches_torchao(ao: dict) -> None:
    x = data("mxfp8_e4m3", 32)
    x = x[(x.abs().amax(1) > 2.0**-110) | (x == 0).all(1)].bfloat16()  # away from the 2**-127 blocks of (1)
    for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
        scale_ao, data_ao = ao["mx"].to_mx(x, torchao_elem_dtype(ao, fmt), 32)
        q = mx_quantize(x, fmt)
        nan_block = q.scales.view(-1).isnan()
        assert bool((same_bits(q.elements, torchao_elements(ao, fmt, data_ao, x.shape)).all(1) | nan_block).all())
        assert bool(same_bits(q.scales.view(-1), scale_ao.float().view(-1)).all())


# ------------------------------------------------------------------------------------------------ ml_dtypes
@pytest.fixture(scope="module")
def ml():
    return pytest.importorskip("ml_dtypes")


def ml_dtype(ml: object, fmt: str) -> object:
    return {
        "mxfp8_e4m3": ml.float8_e4m3fn,
        "mxfp8_e5m2": ml.float8_e5m2,
        "mxfp6_e2m3": ml.float6_e2m3fn,
        "mxfp6_e3m2": ml.float6_e3m2fn,
        "mxfp4_e2m1": ml.float4_e2m1fn,
    }[fmt]


@pytest.mark.parametrize("fmt", [f for f in MX_FORMATS if f != "nvfp4"])
def test_elements_match_ml_dtypes_casts(ml: object, fmt: str) -> None:
    """Every element pattern, every midpoint between neighbours (ties), +-0 and random values: round to
    nearest even as ml_dtypes' cast; beyond the largest element ours saturates (MX quantization clamps first)
    while ml_dtypes' fp8 casts overflow to NaN (e4m3fn) or inf (e5m2)."""
    t = ml_dtype(ml, fmt)
    top = ELEMENTS[fmt][2]
    n_codes = 256 if fmt.startswith("mxfp8") else 2 ** (1 + ELEMENTS[fmt][0] + ELEMENTS[fmt][1])
    codes = np.arange(n_codes, dtype=np.uint8).view(t).astype(np.float32)
    values = torch.from_numpy(codes[np.isfinite(codes)]).sort().values
    mids = (values[1:] + values[:-1]) / 2
    g = torch.Generator().manual_seed(5)
    v = torch.cat([values, mids, torch.tensor([0.0, -0.0]), (torch.rand(20000, generator=g) * 2 - 1) * top])
    ref = torch.from_numpy(v.numpy().astype(t).astype(np.float32))
    assert bool(same_bits(round_elements(v.clone(), fmt), ref).all())
    beyond = torch.tensor([top * 1.2, -top * 3, math.inf, -math.inf])
    assert round_elements(beyond.clone(), fmt).tolist() == [top, -top, top, -top]


def test_scales_are_e8m0_and_e4m3_values(ml: object) -> None:
    x = data("mxfp8_e4m3", 32)
    x = x[~x.isnan().any(1)]
    for fmt, b in MX_FORMATS.items():
        for mode in ("floor", "rceil") if b.scale == "e8m0" else ("e4m3",):
            s = mx_quantize(x.view(-1, b.block_size), fmt, scale_mode=mode).scales.numpy()
            t = ml.float8_e8m0fnu if b.scale == "e8m0" else ml.float8_e4m3fn
            assert np.array_equal(s.astype(t).astype(np.float32), s)
