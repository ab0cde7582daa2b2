"""GPU kernels (Triton, imported lazily) with CPU fallbacks through the emulator.

``two_stage_matmul(a, b)``: seed 003's two-stage fp16 matmul. Each K block is an fp16 ``tl.dot`` that
accumulates in fp16 (``out_dtype=tl.float16``: the tensor-core MMAs of the block chain through an fp16
accumulator), and the block's result is added into fp32 registers outside the MMA. Speed close to an fp16/16
GEMM, error close to one fp16 rounding per block instead of one per MMA of the whole K.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from mixprec._validate import check_dtype

__all__ = ["triton_available", "two_stage_matmul", "two_stage_model"]


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (``pip install mixprec[gpu]``)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def two_stage_model(block_k: int = 16):
    """The emulator's model of the kernel with K blocks of ``block_k``: fp16 inputs, m16n8k16 MMAs (``k_group``
    16) chained in an fp16 accumulator within a block, promoted into fp32 every ``block_k`` products."""
    from mixprec.emulate import MatmulModel

    return MatmulModel(
        inputs="fp16", accumulator="fp16", k_group=16, promote_every=block_k, name=f"two_stage/bk{block_k}"
    )


def two_stage_matmul(
    a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype = torch.float16, block_k: int | None = None
) -> torch.Tensor:
    """``a @ b`` for fp16 ``a (M, K)`` and ``b (K, N)`` with two-stage accumulation; returns ``out_dtype``.

    Args:
        a, b: 2-D float16 tensors on the same device.
        out_dtype: ``torch.float16`` (the fp32 accumulator rounded to nearest once) or ``torch.float32``.
        block_k: K block of the kernel, i.e. the products between promotions to fp32 (16, 32, 64 or 128).
            None: autotuned on the GPU (with the tile sizes); 16 for the CPU fallback, as seed 003's kernel.

    Where it runs: CUDA tensors -> the Triton kernel (needs ``triton``); CPU tensors with ``TRITON_INTERPRET=1``
    and triton installed -> the same kernel in Triton's interpreter (slow; for tests of indexing and masking;
    the interpreter rounds each ``tl.dot`` once, after an fp32 sum of the block's products); other CPU tensors ->
    the emulator, ``mixprec.emulate.matmul`` with :func:`two_stage_model` (``block_k`` or 16).

    Error: per K block one fp16 rounding (unit roundoff 2**-11) of the block's partial sum, then fp32
    accumulation of K / block_k terms: see ``mixprec.emulate.bounds(K, two_stage_model(block_k))``.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dtype != torch.float16:
            raise TypeError(f"{name} must be float16 (the kernel multiplies fp16 on tensor cores); got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D; got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a (M, K) and b (K, N) must agree on K; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device; got {a.device} and {b.device}")
    check_dtype("out_dtype", out_dtype, (torch.float16, torch.float32))
    if block_k is not None and block_k not in (16, 32, 64, 128):
        raise ValueError(f"block_k must be None or one of 16, 32, 64, 128; got {block_k!r}")

    if a.is_cuda or (a.device.type == "cpu" and _interpreting() and triton_available()):
        if not triton_available():
            raise RuntimeError("two_stage_matmul on CUDA needs triton: pip install 'mixprec[gpu]'")
        from mixprec.kernels._two_stage_triton import launch

        return launch(a, b, out_dtype=out_dtype, block_k=block_k)

    from mixprec.emulate.matmul import _matmul_model

    return _matmul_model(a, b, two_stage_model(block_k or 16)).to(out_dtype)
