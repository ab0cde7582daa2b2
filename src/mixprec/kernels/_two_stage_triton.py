"""The Triton two-stage fp16 matmul (imported only when used: needs ``triton``).

Main loop per (BLOCK_M, BLOCK_N) tile: ``block = tl.dot(a, b, out_dtype=tl.float16)`` over one K block (the
tensor cores chain the block's MMAs through an fp16 accumulator, starting from zero), then
``acc += block.to(tl.float32)`` in fp32 registers. Loads of A and B rows/columns past M/N wrap around (their
results are never stored); K is masked only when it is not a multiple of BLOCK_K. Element offsets are int64,
so operands with M*K, K*N or M*N >= 2**31 elements index correctly; the per-block pointer step
``BLOCK_K * stride_k`` is still computed in int32 (Triton passes strides below 2**31 as int32), which limits the
K-direction strides to below 2**31 / BLOCK_K (a transposed operand with more than ~33M rows at BLOCK_K 64).

BLOCK_K is fixed by the caller (``mixprec.kernels.BLOCK_K`` by default); the autotuner chooses only the M/N tiles,
warps and stages, which do not change the result (each output's K blocks are summed in the same order).
"""

# No ``from __future__ import annotations`` here: Triton's interpreter recognises constexpr parameters by their
# annotation object, and would turn string annotations into runtime tensors.
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["launch"]


@triton.jit
def _two_stage_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    OUT_FP16: tl.constexpr,
    K_BLOCKS: tl.constexpr = 0,
):
    # grouped ordering of the tiles so that consecutive programs reuse rows of A in L2
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # int64 element offsets: row * stride in int32 wraps once an operand has 2**31 elements
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    offs_k64 = offs_k.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k64[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k64[:, None] * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if K_BLOCKS == 0:
        # compiled: a for loop over the K blocks (software-pipelined over num_stages)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = K - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            block = tl.dot(a, b, out_dtype=tl.float16)  # stage 1: fp16 accumulation inside the K block
            acc += block.to(tl.float32)  # stage 2: fp32 accumulation across blocks
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    else:
        # interpreter (K_BLOCKS = number of K blocks): the same body in a while loop, because Triton 3.6's
        # interpreter under numpy 2 cannot turn a runtime int into a range bound
        kb = 0
        while kb < K_BLOCKS:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
            block = tl.dot(a, b, out_dtype=tl.float16)
            acc += block.to(tl.float32)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
            kb += 1

    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n.to(tl.int64)[None, :] * stride_cn
    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if OUT_FP16:
        tl.store(c_ptrs, acc.to(tl.float16), mask=c_mask)
    else:
        tl.store(c_ptrs, acc, mask=c_mask)


def _configs(block_k: int) -> list[triton.Config]:
    shapes = [(128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]


_AUTOTUNED: dict[int, Any] = {}  # block_k -> triton Autotuner over the M/N tiles


def _autotuned(block_k: int) -> Any:
    if block_k not in _AUTOTUNED:
        _AUTOTUNED[block_k] = triton.autotune(configs=_configs(block_k), key=["M", "N", "K"])(_two_stage_kernel)
    return _AUTOTUNED[block_k]


def launch(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype, block_k: int) -> torch.Tensor:
    """Run the kernel (arguments validated by ``mixprec.kernels.two_stage_matmul``)."""
    from mixprec.kernels import _interpreting

    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()
    out_fp16 = out_dtype == torch.float16
    even_k = k % block_k == 0
    args = (a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    if _interpreting():
        # the interpreter runs each program in numpy: small tiles, no autotuning
        grid = (triton.cdiv(m, 16) * triton.cdiv(n, 16),)
        _two_stage_kernel[grid](
            *args,
            BLOCK_M=16,
            BLOCK_N=16,
            BLOCK_K=block_k,
            GROUP_M=4,
            EVEN_K=even_k,
            OUT_FP16=out_fp16,
            K_BLOCKS=triton.cdiv(k, block_k),
        )
        return c
    tuner = _autotuned(block_k)

    def grid(meta: dict) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    tuner[grid](*args, EVEN_K=even_k, OUT_FP16=out_fp16)
    return c
