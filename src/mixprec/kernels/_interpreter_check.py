"""Run the two-stage kernel in Triton's interpreter on small odd shapes and compare with the emulator; prints JSON.

    TRITON_INTERPRET=1 python -m mixprec.kernels._interpreter_check

(TRITON_INTERPRET must be set before triton is imported, hence a separate process.) Each interpreted ``tl.dot``
is numpy's fp16 matmul: the block's products summed in fp32, rounded once to fp16. The emulator's model with
``k_group = block_k`` rounds the exact block sum instead; the fp32 sum is within ``gamma_bk(2**-24) sum|p|`` of
it, so the two fp16 roundings differ by at most one fp16 spacing (``<= 2**-10 |block| <= 2**-10 (|A||B|)_ij``) per
block, plus the fp32 accumulation of those differences: ``tol = nblocks (2**-10 + 2**-23) (|A||B|)_ij`` (and one
more fp16 spacing of the output for fp16 outputs). ``max_ratio <= 1`` means within that bound.
"""

from __future__ import annotations

import json

import torch

CASES = [(17, 50, 33, 16, "fp32"), (5, 64, 20, 32, "fp16"), (33, 47, 18, 32, "fp32")]


def check() -> list[dict[str, object]]:
    from mixprec.emulate import MatmulModel, matmul
    from mixprec.kernels import _interpreting, two_stage_matmul

    if not _interpreting():
        raise RuntimeError("set TRITON_INTERPRET=1 before running this check")
    out = []
    for m, k, n, bk, dt in CASES:
        gen = torch.Generator().manual_seed(m * k + n)
        a = torch.randn(m, k, generator=gen).half()
        b = torch.randn(k, n, generator=gen).half()
        dtype = torch.float32 if dt == "fp32" else torch.float16
        got = two_stage_matmul(a, b, out_dtype=dtype, block_k=bk).double()
        model = MatmulModel(inputs="fp16", accumulator="fp16", k_group=bk, promote_every=bk)
        emu = matmul(a, b, mode=model).to(dtype).double()
        absab = a.double().abs() @ b.double().abs()
        nblocks = -(-k // bk)
        tol = nblocks * (2.0**-10 + 2.0**-23) * absab
        if dtype == torch.float16:
            tol = tol + 2.0**-10 * emu.abs()
        diff = (got - emu).abs()
        out.append(
            {
                "shape": [m, k, n],
                "block_k": bk,
                "out": dt,
                "max_ratio": float((diff / tol).max()),
                "equal_fraction": float((diff == 0).double().mean()),
            }
        )
    return out


if __name__ == "__main__":
    print(json.dumps(check()))
