"""The compiled emulated matmul against the torch path (``mixprec.native.disabled()``), bit for bit: every preset,
odd shapes, batches, overflow, subnormal group sums, signed zeros, inf/NaN, fp8 inputs, promotion, other
accumulator formats, operand dtypes and thread counts. Data keeps each group's terms within 53 bits of each other
(docs/emulate.md, "The compiled kernel"): there the fp64 group sums are exact and the summation order is free."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import mixprec.native as native
from mixprec.emulate import MATMUL_PRESETS, FloatFormat, MatmulModel, matmul
from mixprec.emulate.matmul import matmul_with_model

pytestmark = pytest.mark.skipif(native.library() is None, reason="compiled kernels unavailable")


def assert_same_bits(x: torch.Tensor, y: torch.Tensor) -> None:
    assert x.shape == y.shape and x.dtype == y.dtype == torch.float32
    nan_x, nan_y = torch.isnan(x), torch.isnan(y)
    assert torch.equal(nan_x, nan_y)
    diff = x.masked_fill(nan_x, 0).view(torch.int32) != y.masked_fill(nan_y, 0).view(torch.int32)
    assert not bool(diff.any()), (x[diff][:5].tolist(), y[diff][:5].tolist())


def both(a: torch.Tensor, b: torch.Tensor, mode: MatmulModel | str, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    got = matmul(a, b, mode=mode, **kw)
    with native.disabled():
        want = matmul(a, b, mode=mode, **kw)
    return got, want


def mixed(shape: tuple[int, ...], gen: torch.Generator, spread: int = 6) -> torch.Tensor:
    """Ties and cancellations (small integers), normal data, signed zeros, magnitudes 2**-spread..2**spread."""
    ints = torch.randint(-8, 9, shape, generator=gen).float()
    normal = torch.randn(shape, generator=gen)
    pick = torch.randint(0, 3, shape, generator=gen)
    x = torch.where(pick == 0, ints, normal)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, shape, generator=gen).float())
    x[pick == 2] = 0.0
    x[(pick == 2) & (torch.rand(shape, generator=gen) < 0.5)] = -0.0
    return x


def test_the_compiled_kernel_runs(monkeypatch):
    module = importlib.import_module("mixprec.emulate.matmul")  # the package's `matmul` shadows the module
    calls = []
    real = module._native_accumulate
    monkeypatch.setattr(module, "_native_accumulate", lambda *args: calls.append(1) or real(*args))
    a = torch.randn(4, 20)
    matmul(a, torch.randn(20, 3), mode="fp16/16")
    assert calls == [1]
    with native.disabled():
        matmul(a, torch.randn(20, 3), mode="fp16/16")
    matmul(a, torch.randn(20, 3), mode="fp16/32-h100")  # the alignment model stays on the torch path
    assert calls == [1]


SHAPES = [(1, 1, 1), (3, 17, 5), (17, 33, 3), (33, 1, 17), (5, 37, 33), (13, 50, 31)]
PRESETS = [name for name, model in MATMUL_PRESETS.items() if model.align_bits is None]


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_presets_on_odd_shapes(name, shape):
    m, k, n = shape
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    assert_same_bits(*both(mixed((m, k), gen), mixed((k, n), gen), name))


def test_medium_shape_crosses_every_block_edge():
    # 200 rows > one 192-row block, 300 columns > one 256-column block, K = 530 spans three K blocks
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(200, 530, generator=gen), torch.randn(530, 300, generator=gen)
    for name in ("fp16/16", "bf16/32", "two_stage"):
        assert_same_bits(*both(a, b, name))


def test_thread_count_does_not_change_bits():
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(250, 300, generator=gen), torch.randn(300, 270, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = matmul(a, b, mode="fp16/16")
        torch.set_num_threads(2)
        two = matmul(a, b, mode="fp16/16")
    finally:
        torch.set_num_threads(before)
    assert_same_bits(one, two)
    with native.disabled():
        assert_same_bits(one, matmul(a, b, mode="fp16/16"))


@pytest.mark.parametrize(
    "model",
    [
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=1),
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=3, promote_every=6),
        MatmulModel(inputs="fp16", accumulator="fp32", k_group=32, promote_every=64, output="bf16"),
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=100),  # K blocks of 200
        MatmulModel(inputs="bf16", accumulator="fp16", k_group=300),  # groups span K blocks of 256
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=160, promote_every=320),  # K 333 padded to 480
        MatmulModel(inputs="bf16", accumulator="bf16", k_group=4),
        MatmulModel(inputs="fp32", accumulator="bf16", k_group=2),
        MatmulModel(inputs="fp8_e4m3", accumulator="fp16", k_group=16, promote_every=32),
        MatmulModel(inputs="fp8_e5m2", accumulator="fp32", k_group=32),
        MatmulModel(inputs="fp8_e4m3", accumulator="fp8_e4m3", k_group=2),
        MatmulModel(inputs="fp16", accumulator="fp8_e5m2", k_group=4, output="fp16"),
        MatmulModel(inputs="fp16", accumulator=FloatFormat(5, 10, subnormals=False), k_group=8),
        MatmulModel(inputs="fp16", accumulator=FloatFormat(8, 10), k_group=16),  # tf32-like
        MatmulModel(inputs="fp16", accumulator=FloatFormat(5, 10, saturate=True), k_group=4),
    ],
    ids=lambda m: m.name,
)
def test_models_beyond_the_presets(model):
    gen = torch.Generator().manual_seed(8)
    a, b = mixed((19, 333), gen), mixed((333, 21), gen)
    assert_same_bits(*both(a, b, model))


@pytest.mark.parametrize("name", ["fp16/16", "fp16/32", "bf16/32", "two_stage"])
def test_batches_broadcast_and_strides(name):
    gen = torch.Generator().manual_seed(6)
    a = mixed((2, 3, 5, 40), gen)
    cases = [
        (a, mixed((40, 7), gen)),  # b shared: the batch folds into rows
        (a[0], mixed((3, 40, 7), gen)),  # batch-matched
        (a[:1, :1], mixed((3, 40, 7), gen)),  # a broadcast over b's batch
        (a, mixed((3, 40, 7), gen)),  # (2, 3) broadcast with (3,)
        (mixed((37, 9), gen).t(), mixed((37, 11), gen)),  # transposed a
        (mixed((6, 37), gen), mixed((11, 37), gen).t()),  # transposed b
        (mixed((6, 74), gen)[:, ::2], mixed((37, 22), gen)[:, ::2]),  # strided columns
        (mixed((4, 1, 6, 37), gen), mixed((37, 5), gen).expand(4, 3, 37, 5)),  # stride-0 batch of b
        (mixed((0, 6, 37), gen), mixed((37, 5), gen)),  # empty batch
        (mixed((6, 0), gen), mixed((0, 5), gen)),  # K = 0
    ]
    for x, y in cases:
        assert_same_bits(*both(x, y, name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["fp16/16", "bf16/32", "fp8/nopromote"])
def test_operand_dtypes_and_prerounded_operands(dtype, name):
    gen = torch.Generator().manual_seed(7)
    a, b = mixed((9, 45), gen).to(dtype), mixed((45, 10), gen).to(dtype)
    model = MATMUL_PRESETS[name]
    if name == "fp8/nopromote":
        model = MatmulModel(inputs="fp8_e4m3", accumulator="fp32", k_group=32)
    assert_same_bits(*both(a, b, model))
    # fp64 values that need rounding: torch's double cast would round twice, round_to once
    tie = torch.tensor([[1.0 + 2.0**-11 + 2.0**-40, 3.0]], dtype=torch.float64)
    assert_same_bits(*both(tie, torch.ones(2, 1, dtype=torch.float64), model))
    rounded = matmul(a, b, mode=model)  # operands already representable: rounded=True must not change them
    ar, br = (x.to(model.inputs.torch_dtype or torch.float32).to(dtype) for x in (a, b))
    if model.inputs.torch_dtype is None:
        from mixprec.emulate import round_to

        ar, br = round_to(a, model.inputs).to(dtype), round_to(b, model.inputs).to(dtype)
    got = matmul_with_model(ar, br, model, rounded=True)
    with native.disabled():
        want = matmul_with_model(ar, br, model, rounded=True)
    assert_same_bits(got, want)
    assert_same_bits(got, rounded)


@pytest.mark.parametrize("name", ["fp16/16", "fp16/32", "bf16/32", "two_stage"])
def test_overflow_to_inf_and_back(name):
    gen = torch.Generator().manual_seed(9)
    # rows of large values: the fp16 accumulator overflows to inf part-way (its format rule), the fp32 ones not;
    # a later negative group cannot bring inf back
    a = torch.full((6, 96), 100.0)
    a[1, 48:] = -100.0
    a[2] = torch.randn(96, generator=gen) * 300
    a[3, :16] = 60000.0
    a[4] = torch.tensor([60000.0, -60000.0] * 48)
    a[5, 0] = 65504.0
    a[5, 1] = 1e5  # beyond fp16: an inf operand after rounding to the inputs
    b = torch.full((96, 5), 20.0)
    b[:, 1] = torch.randn(96, generator=gen) * 50
    b[:, 2] = 2.0
    b[48:, 3] = -20.0
    assert_same_bits(*both(a, b, name))
    got, _ = both(a, b, "fp16/16")
    assert bool(torch.isinf(got).any())


def test_subnormal_group_sums_and_flush():
    gen = torch.Generator().manual_seed(10)
    # products near fp16's smallest subnormal (2**-24): group sums land on the subnormal grid, round to it, tie
    a = torch.randint(-3, 4, (23, 64), generator=gen).float() * 2.0**-12
    b = torch.randint(-3, 4, (64, 17), generator=gen).float() * 2.0**-13
    for model in (
        MATMUL_PRESETS["fp16/16"],
        MATMUL_PRESETS["two_stage"],
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=1),
        MatmulModel(inputs="fp16", accumulator=FloatFormat(5, 10, subnormals=False), k_group=4),
        MatmulModel(inputs="fp16", accumulator="fp8_e5m2", k_group=2),
        MatmulModel(inputs="bf16", accumulator="bf16", k_group=4),
    ):
        got, want = both(a, b, model)
        assert_same_bits(got, want)
    # bf16 inputs near fp32's subnormal range: products below 2**-126 summed exactly, rounded by fp32's cast
    tiny = torch.randint(-3, 4, (7, 32), generator=gen).float() * 2.0**-70
    assert_same_bits(*both(tiny, torch.randint(-3, 4, (32, 5), generator=gen).float() * 2.0**-70, "bf16/32"))


@pytest.mark.parametrize("name", PRESETS)
def test_signed_zeros_inf_and_nan_operands(name):
    a = torch.tensor(
        [
            [0.0, -0.0, 0.0, -0.0],
            [-0.0, -0.0, -0.0, -0.0],
            [1.0, -1.0, 2.0, -2.0],  # cancels to an exact zero
            [math.inf, 1.0, 0.0, 0.0],
            [math.inf, 0.0, 1.0, 0.0],  # inf * 0 in the group: NaN
            [math.inf, -math.inf, 1.0, 1.0],
            [math.nan, 1.0, 1.0, 1.0],
            [-math.inf, 1.0, 1.0, 1.0],
            [-(2.0**-13), 0.0, 0.0, 0.0],  # times 2**-13: below half fp16's smallest subnormal, a zero (+0)
        ]
    )
    b = torch.tensor([[1.0, -1.0, 0.0, 2.0**-13], [1.0, 1.0, -0.0, 0.0], [1.0, 0.5, 0.0, -0.0], [1.0, 0.25, -0.0, 0.0]])
    got, want = both(a, b, name)
    assert_same_bits(got, want)
    # with fp16 inputs and k_group=1 each zero is its own step
    assert_same_bits(*both(a, b, MatmulModel(inputs="fp16", accumulator="fp16", k_group=1)))
    assert_same_bits(*both(a, b, MatmulModel(inputs="fp16", accumulator="fp32", k_group=1)))


@pytest.mark.parametrize("k_group", [1, 2, 16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (64, 17, 1), (64, 17, 16), (200, 64, 3)])
def test_a_sum_of_negative_zeros_is_positive_zero_on_both_paths(k_group, shape):
    # An fp32 accumulator starts each chain at +0, as an MMA's zeroed accumulator does, so products that are
    # all -0 sum to +0. The torch path once took its first group from torch.bmm, whose sign of zero depends on
    # the BLAS kernel that the shape selects (MKL's gave -0 for one-product groups at 64 x 17, +0 at 8 x 8).
    m, n, k = shape
    model = MatmulModel(inputs="fp16", accumulator="fp32", k_group=k_group)
    got, want = both(-torch.ones(m, k), torch.zeros(k, n), model)
    assert_same_bits(got, want)
    assert not bool(torch.signbit(want).any())
