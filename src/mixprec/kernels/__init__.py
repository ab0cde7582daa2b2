"""GPU kernels (Triton, imported lazily: an optional, heavy dependency) with CPU fallbacks through the emulator.

``two_stage_matmul(a, b)``: the two-stage fp16 matmul of "Improving FP16/16 matmul accuracy with two-stage
accumulation" (spatters/mma-matmul, kernel 3.2). Each K block is an fp16 ``tl.dot`` that accumulates in fp16
(``out_dtype=tl.float16``: the tensor-core MMAs of the block chain through an fp16 accumulator), and the block's
result is added into fp32 registers outside the MMA. Speed close to an fp16/16 GEMM, error close to one fp16
rounding per block instead of one per MMA of the whole K.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.core.validate import check_dtype, check_tensor
from mixprec.emulate.matmul import MatmulModel, matmul_with_model
from mixprec.native import gpu

__all__ = ["BLOCK_K", "BLOCK_K_CHOICES", "triton_available", "two_stage_matmul", "two_stage_model"]

# The kernel's K block, i.e. the products between promotions to fp32. One fixed default on every path (GPU, Triton
# interpreter, CPU emulator), so that the numerics do not depend on where it runs or on what an autotuner picks:
# the autotuner only chooses the M/N tile sizes. 64 is the BLOCK_K the H200 autotuner chose among {32, 64} at
# M=N=K=4096 and 8192 (benchmarks/RESULTS.md); pass block_k=16 for the original kernel 3.2 design (promotion every MMA).
BLOCK_K = 64
BLOCK_K_CHOICES = (16, 32, 64, 128)


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (``pip install mixprec[gpu]``)."""
    return gpu.available()


# TRITON_INTERPRET's reading (Triton's own rule), shared with the kernels of mixprec.native.gpu
_interpreting = gpu.interpreting


def _check_block_k(block_k: Any) -> int:
    if isinstance(block_k, bool) or not isinstance(block_k, int):
        raise TypeError(f"block_k must be an int, one of {BLOCK_K_CHOICES}; got {type(block_k).__name__} {block_k!r}")
    if block_k not in BLOCK_K_CHOICES:
        raise ValueError(f"block_k must be one of {', '.join(map(str, BLOCK_K_CHOICES))}; got {block_k!r}")
    return block_k


def two_stage_model(block_k: int = BLOCK_K) -> MatmulModel:
    """The emulator's model of the kernel with K blocks of ``block_k`` (16, 32, 64 or 128): fp16 inputs, m16n8k16
    MMAs (``k_group`` 16) chained in an fp16 accumulator within a block, promoted into fp32 every ``block_k``
    products."""
    _check_block_k(block_k)
    return MatmulModel(
        inputs="fp16", accumulator="fp16", k_group=16, promote_every=block_k, name=f"two_stage/bk{block_k}"
    )


def two_stage_matmul(
    a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype = torch.float16, block_k: int = BLOCK_K
) -> torch.Tensor:
    """``a @ b`` for fp16 ``a (M, K)`` and ``b (K, N)`` with two-stage accumulation; returns ``out_dtype``.

    Args:
        a, b: 2-D float16 tensors on the same device.
        out_dtype: ``torch.float16`` (the fp32 accumulator rounded to nearest once) or ``torch.float32``.
        block_k: K block of the kernel, i.e. the products between promotions to fp32: 16, 32, 64 or 128, default
            :data:`BLOCK_K` (64) on every path. The GPU autotunes only the M/N tiles, so the result does not depend
            on the autotuner's choice.

    Where it runs: CUDA tensors -> the Triton kernel (needs ``triton``); CPU tensors with ``TRITON_INTERPRET=1``
    and triton installed -> the same kernel in Triton's interpreter (slow; for tests of indexing and masking;
    the interpreter rounds each ``tl.dot`` once, after an fp32 sum of the block's products); other CPU tensors ->
    the emulator, ``mixprec.emulate.matmul`` with :func:`two_stage_model` ``(block_k)``.

    Autograd: not recorded; operands that require grad (with grad mode on) raise ValueError.

    Error: per K block ``block_k / 16`` fp16 roundings (unit roundoff 2**-11) of the block's partial sums, then fp32
    accumulation of K / block_k terms: see ``mixprec.emulate.bounds(K, two_stage_model(block_k))``.
    """
    for name, t in (("a", a), ("b", b)):
        check_tensor(name, t, (torch.float16,))
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D; got shape {tuple(t.shape)}")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad, but two_stage_matmul records no autograd graph: pass .detach()")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a (M, K) and b (K, N) must agree on K; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device; got {a.device} and {b.device}")
    check_dtype("out_dtype", out_dtype, (torch.float16, torch.float32))
    _check_block_k(block_k)

    if a.is_cuda or (a.device.type == "cpu" and _interpreting() and triton_available()):
        if not triton_available():
            raise RuntimeError("two_stage_matmul on CUDA needs triton: pip install 'mixprec[gpu]'")
        from mixprec.kernels._two_stage_triton import launch

        return launch(a, b, out_dtype=out_dtype, block_k=block_k)

    return matmul_with_model(a, b, two_stage_model(block_k)).to(out_dtype)
