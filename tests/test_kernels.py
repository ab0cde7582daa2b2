"""mixprec.kernels.two_stage_matmul: the CPU fallback is the emulator's model of the kernel; under Triton's
interpreter (when triton is installed) the kernel itself is checked on small odd shapes against the emulator with
the same block size; on a CUDA device against the emulator within the model's bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mixprec.emulate import MatmulModel, bounds, matmul
from mixprec.kernels import BLOCK_K, _interpreting, triton_available, two_stage_matmul, two_stage_model

U32 = 2.0**-24


def test_cpu_fallback_is_the_emulator():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, 70, generator=gen).half()
    b = torch.randn(70, 29, generator=gen).half()
    if _interpreting() and triton_available():
        pytest.skip("TRITON_INTERPRET is set: CPU tensors go to the interpreted kernel")
    for block_k, out_dtype in ((16, torch.float16), (32, torch.float32), (64, torch.float16), (128, torch.float32)):
        got = two_stage_matmul(a, b, out_dtype=out_dtype, block_k=block_k)
        want = matmul(a, b, mode=two_stage_model(block_k)).to(out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, want)
    assert two_stage_model(16) == MatmulModel(inputs="fp16", accumulator="fp16", k_group=16, promote_every=16)


def test_one_fixed_default_block_k_on_every_path():
    # the default K block is a constant (the GPU autotunes only the M/N tiles), so the default call's
    # numerics are those of two_stage_model(BLOCK_K) wherever it runs
    if _interpreting() and triton_available():
        pytest.skip("TRITON_INTERPRET is set: CPU tensors go to the interpreted kernel")
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(9, 200, generator=gen).half()
    b = torch.randn(200, 11, generator=gen).half()
    assert BLOCK_K == 64 and two_stage_model().promote_every == BLOCK_K
    got = two_stage_matmul(a, b, out_dtype=torch.float32)
    assert torch.equal(got, matmul(a, b, mode=two_stage_model(BLOCK_K)))
    assert not torch.equal(got, two_stage_matmul(a, b, out_dtype=torch.float32, block_k=16))  # block_k matters


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: two_stage_matmul(torch.ones(2, 3), torch.ones(3, 2).half()), TypeError, "float16"),
        (lambda: two_stage_matmul(torch.ones(2, 3).half(), torch.ones(4, 2).half()), ValueError, "agree on K"),
        (lambda: two_stage_matmul(torch.ones(3).half(), torch.ones(3, 2).half()), ValueError, "2-D"),
        (
            lambda: two_stage_matmul(torch.ones(2, 3).half(), torch.ones(3, 2).half(), out_dtype=torch.bfloat16),
            ValueError,
            "out_dtype",
        ),
        (lambda: two_stage_matmul(torch.ones(2, 3).half(), torch.ones(3, 2).half(), block_k=24), ValueError, "block_k"),
        (lambda: two_stage_matmul("a", torch.ones(3, 2).half()), TypeError, "torch.Tensor"),
        (
            lambda: two_stage_matmul(torch.ones(2, 3).half(), torch.ones(3, 2).half(), block_k=None),
            TypeError,
            "block_k",
        ),
        (lambda: two_stage_model(24), ValueError, "block_k"),
        (
            lambda: two_stage_matmul(torch.ones(2, 3).half().requires_grad_(), torch.ones(3, 2).half()),
            ValueError,
            "requires grad",
        ),
        (lambda: two_stage_model(32.0), TypeError, "block_k"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed (pip install 'mixprec[gpu]')")
def test_kernel_under_triton_interpreter_matches_emulator():
    # In a fresh process: TRITON_INTERPRET must be set before triton.jit runs. The tolerance is derived in
    # mixprec/kernels/_interpreter_check.py (one fp16 spacing per K block, from the interpreter's fp32 block sum).
    env = dict(os.environ, TRITON_INTERPRET="1")
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "mixprec.kernels._interpreter_check"], env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(cases) == 3
    for case in cases:
        assert case["max_ratio"] <= 1.0, case
        # A mismatch needs the exact block sum s to lie within the fp32 sum's error, gamma_bk(2**-24) sum|p|,
        # of an fp16 rounding boundary (spacing ~ 2**-10 |s|): per block a chance of about
        # 2 bk 2**-24 sum|p| / (2**-10 |s|) ~ bk 2**-13 * 0.8 sqrt(bk) for N(0,1) data (sum|p| ~ 0.64 bk,
        # |s| ~ 0.8 sqrt(bk)), i.e. ~2% for bk=32, and outputs have <= 4 blocks: an expected equal fraction
        # >= ~0.92 (an estimate, not a bound; measured 1.0, 1.0, 0.998). A flip is within the bound above
        # (max_ratio); this catches a systematic indexing/masking error that stays under it.
        assert case["equal_fraction"] >= 0.9, case


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(_interpreting(), reason="compiled kernel only")
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("block_k", [32, 64])
def test_kernel_on_gpu_within_bound_of_emulator(block_k):
    # On the GPU each K block is a chain of block_k/16 MMAs (K=16 each) through an fp16 accumulator: the emulator's
    # two_stage_model(block_k). The tensor cores' internal alignment/truncation may move each MMA's fp16 result by
    # one spacing (<= 2**-10 |acc|) from the exact model's: per block at most (block_k/16) 2**-10 sum|p|, in total
    # (block_k/16) 2**-10 (|A||B|)_ij, plus the fp32 accumulation of those differences (2 (K/block_k) u32).
    gen = torch.Generator().manual_seed(block_k)
    model = two_stage_model(block_k)
    for m, k, n in [(129, 200, 65), (1024, 1024, 1024), (7, 4096, 300)]:
        a = torch.randn(m, k, generator=gen).half().cuda()
        b = torch.randn(k, n, generator=gen).half().cuda()
        got = two_stage_matmul(a, b, out_dtype=torch.float32, block_k=block_k).double()
        emu = matmul(a, b, mode=model).double()
        absab = a.double().abs() @ b.double().abs()
        hw = (block_k / 16) * 2.0**-10
        assert bool(((got - emu).abs() <= (hw + 2 * (k / block_k) * U32) * absab).all())
        ref = a.double() @ b.double()
        assert bool(((got - ref).abs() <= (bounds(k, model).deterministic + hw) * absab).all())
