"""matmul with modelled accumulators: hand-worked cases, an exact rational reference of the whole model, batching,
error ordering of the presets, measured errors against bounds(), clear errors."""

from __future__ import annotations

import math

import pytest
import torch

from emulate_reference import ref_matmul_element
from mixprec.emulate import MATMUL_PRESETS, MatmulModel, bounds, get_format, get_matmul_model, matmul, round_to
from mixprec.emulate.matmul import TENSOR_CORE_ALIGN_BITS


def test_hand_worked_2048_plus_ones():
    # 2048 + 31 ones: fp16 spacing at 2048 is 2, so with k_group=1 every "+1" is a tie that rounds back to 2048
    # (even); fp32 holds 2079 exactly; one exact group of 32 rounds once: 2079 -> 2080 (tie, even mantissa).
    a = torch.tensor([[2048.0] + [1.0] * 31])
    b = torch.ones(32, 1)
    assert matmul(a, b, accumulator="fp16", k_group=1).item() == 2048.0
    assert matmul(a, b, accumulator="fp32", k_group=1).item() == 2079.0
    assert matmul(a, b, accumulator="fp16", k_group=32).item() == 2080.0
    # groups of 16: 2048 + 15 = 2063 is a tie between 2062 (odd mantissa) and 2064 (even) -> 2064; + 16 -> 2080
    assert matmul(a, b, accumulator="fp16", k_group=16).item() == 2080.0
    # the ones first: 31 exact, then 2048 + 31 = 2079 -> 2080
    assert matmul(a.flip(1), b, accumulator="fp16", k_group=1).item() == 2080.0
    # two-stage: each group of 16 rounded to fp16 on its own (2063 -> 2064, 16 -> 16), then summed in fp32
    assert matmul(a, b, mode="two_stage").item() == 2080.0
    b2 = torch.ones(32, 1)
    b2[0] = 0.5  # 1024 + 15 = 1039 is exact in fp16 (spacing 1 below 2048): all models agree on 1055
    assert {matmul(a, b2, mode=m).item() for m in ("fp16/16", "two_stage", "fp16/32")} == {1055.0}


def test_overflow_saturation_and_output_rounding():
    a = torch.full((1, 64), 100.0)
    b = torch.full((64, 1), 20.0)  # 64 * 2000 = 128000 > 65504
    assert matmul(a, b, mode="fp16/16").item() == math.inf
    assert matmul(a, b, mode="fp16/32").item() == 128000.0
    assert matmul(a, b, mode="fp16/32", output="fp16").item() == math.inf
    assert matmul(a, b, mode="two_stage").item() == 128000.0  # each MMA sums to 32000: fits fp16
    sat = get_format("fp8_e4m3")
    assert matmul(a, b, inputs="fp32", accumulator=sat, k_group=1).item() == 448.0
    # a NaN operand gives NaN, an inf one inf
    nan_a = torch.tensor([[math.nan, 1.0]])
    assert math.isnan(matmul(nan_a, torch.ones(2, 1)).item())
    assert matmul(torch.tensor([[math.inf, 1.0]]), torch.ones(2, 1)).item() == math.inf


def test_overflow_from_accumulator_rounding_growth_gives_inf():
    # Regression. sum|a_k b_k| = 49152 + 600 * 16.015625 = 58761.4, below 65504 / 1.01, so the old
    # cheap bound skipped the per-step overflow check. But with k_group=1 the fp16 accumulator (spacing 32 in
    # [32768, 65536)) rounds every "+16.015625" up to "+32": the true model value reaches 65536 after 512 steps and
    # overflows to inf. The old code returned the finite non-fp16 value 65536.0 on the 64x64 product (where the
    # bound is worth computing) and inf on the 1x1 product (where it is not).
    a = torch.ones(64, 601)
    b = torch.full((601, 64), 16.015625)
    b[0] = 49152.0
    fp16 = get_format("fp16")
    # the exact reference (it cannot continue past inf): 49152 + 32 * 511 = 65504 = max, the next step overflows
    assert ref_matmul_element(a[0, :512].tolist(), b[:512, 0].tolist(), acc=fp16, k_group=1, promote_every=None) == (
        65504.0
    )
    assert ref_matmul_element(a[0, :513].tolist(), b[:513, 0].tolist(), acc=fp16, k_group=1, promote_every=None) == (
        math.inf
    )
    assert matmul(a[:1], b[:, :1], accumulator="fp16", k_group=1).item() == math.inf
    got = matmul(a, b, accumulator="fp16", k_group=1)
    assert bool((got == math.inf).all())


@pytest.mark.parametrize(
    "model",
    [
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=1),
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=4),
        # bf16: an unchecked 2**128 would become inf in the fp32 result anyway; kept for the bound at fp32's range
        MatmulModel(inputs="fp32", accumulator="bf16", k_group=2),
        MatmulModel(inputs="fp16", accumulator="fp16", k_group=1, promote_every=64),
    ],
    ids=lambda m: m.name,
)
def test_large_products_near_the_accumulators_max_match_the_always_checked_path(model):
    # A 16x32 output computes the growth bound and may skip the per-step overflow check; one output row at a time
    # (operands larger than the per-step checks) always checks. Column j: one large term 1.5 * 2**emax, then
    # n_j groups whose sum is (1/2 + 2**-6) of the accumulator's top spacing, so every group rounds up by a whole
    # spacing (growth ~2x the exact sum, as in the test above), and zeros after: about half the columns overflow,
    # although every exact sum stays below max / 1.01. Both paths must agree bit for bit (inf included).
    acc = get_format(model.accumulator)
    kg = model.k_group
    top_spacing = 2.0 ** (acc.emax - acc.man_bits)
    big = 1.5 * 2.0**acc.emax
    steps_to_overflow = math.ceil((acc.max_finite - big) / top_spacing)
    n = [max(1, steps_to_overflow + d) for d in range(-16, 16)]
    inc = top_spacing * (0.5 + 2.0**-6) / kg
    b = torch.zeros(1 + max(n) * kg, 32)
    b[0] = big
    for j, nj in enumerate(n):
        b[1 : 1 + nj * kg, j] = inc
    assert float(b.sum(0).max()) < acc.max_finite / 1.01  # the old 1.01 margin would have skipped the check
    a = torch.ones(16, b.shape[0])
    whole = matmul(a, b, mode=model)
    rows = torch.cat([matmul(a[i : i + 1], b, mode=model) for i in range(16)])
    assert torch.equal(whole, rows)
    if model.promote_every is None:  # the low-precision chain sees every group: some columns overflow
        assert 0 < int(torch.isinf(whole[0]).sum()) < 32


MODELS_FOR_REFERENCE = [
    MatmulModel(inputs="fp16", accumulator="fp16", k_group=1),
    MatmulModel(inputs="fp16", accumulator="fp16", k_group=16),
    MatmulModel(inputs="fp16", accumulator="fp16", k_group=8, promote_every=32),
    MatmulModel(inputs="bf16", accumulator="bf16", k_group=4),
    MatmulModel(inputs="fp16", accumulator="fp32", k_group=16),
    MatmulModel(inputs="fp8_e5m2", accumulator="fp16", k_group=4, promote_every=8, output="bf16"),
    MatmulModel(
        inputs="fp16",
        accumulator="fp16",
        k_group=16,
        align_bits=TENSOR_CORE_ALIGN_BITS["h100"],
        align_rounding="nearest",
    ),
    MatmulModel(inputs="fp16", accumulator="fp32", k_group=4, align_bits=TENSOR_CORE_ALIGN_BITS["v100"]),
    MATMUL_PRESETS["fp8/promote128"],
    MATMUL_PRESETS["fp8/nopromote"],
]


@pytest.mark.parametrize("model", MODELS_FOR_REFERENCE, ids=lambda m: m.name)
def test_matches_exact_reference_of_the_model(model):
    gen = torch.Generator().manual_seed(11)
    m, k, n = 3, 150, 4
    # mixed magnitudes: many ties and cancellations (small integers), normal data, tiny and large values
    a = torch.cat(
        [
            torch.randint(-4, 5, (1, k), generator=gen).float() * 64,
            torch.randn(1, k, generator=gen),
            torch.randn(1, k, generator=gen) * torch.exp2(torch.randint(-12, 6, (1, k), generator=gen).float()),
        ]
    )
    b = torch.cat(
        [
            torch.randint(-3, 4, (k, 2), generator=gen).float(),
            torch.randn(k, 2, generator=gen) * torch.exp2(torch.randint(-8, 4, (k, 2), generator=gen).float()),
        ],
        dim=1,
    )
    got = matmul(a, b, mode=model)
    ar, br = round_to(a, model.inputs), round_to(b, model.inputs)
    for i in range(m):
        for j in range(n):
            want = ref_matmul_element(
                ar[i].tolist(),
                br[:, j].tolist(),
                acc=model.accumulator,
                k_group=model.k_group,
                promote_every=model.promote_every,
                align_bits=model.align_bits,
                align_rounding=model.align_rounding,
            )
            if model.output is not None:
                want = round_to(torch.tensor([want], dtype=torch.float64), model.output).item()
            assert got[i, j].item() == want, (i, j, got[i, j].item(), want)


def test_batched_and_broadcast_inputs_equal_per_matrix_products():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(2, 3, 5, 40, generator=gen)
    b = torch.randn(40, 7, generator=gen)
    got = matmul(a, b, mode="fp16/16")
    assert got.shape == (2, 3, 5, 7) and got.dtype == torch.float32
    for i in range(2):
        for j in range(3):
            assert torch.equal(got[i, j], matmul(a[i, j], b, mode="fp16/16"))
    bb = torch.randn(3, 40, 7, generator=gen)
    got = matmul(a[0], bb, mode="two_stage")
    for j in range(3):
        assert torch.equal(got[j], matmul(a[0, j], bb[j], mode="two_stage"))
    got = matmul(a[:1, :1], bb, mode="bf16/32")  # (1, 1, 5, 40) @ (3, 40, 7) -> (1, 3, 5, 7)
    assert got.shape == (1, 3, 5, 7)
    assert torch.equal(got[0, 2], matmul(a[0, 0], bb[2], mode="bf16/32"))
    # non-contiguous operands and K not a multiple of k_group
    at = torch.randn(37, 9, generator=gen).t()
    assert torch.equal(matmul(at, b[:37], mode="fp16/16"), matmul(at.contiguous(), b[:37], mode="fp16/16"))


def test_tiling_does_not_change_results():
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(300, 64, generator=gen), torch.randn(64, 700, generator=gen)
    whole = matmul(a, b, mode="fp16/16")
    rows = torch.cat([matmul(a[i : i + 1], b, mode="fp16/16") for i in range(0, 300, 37)])
    assert torch.equal(whole[::37], rows)


def normalized_errors(mode: str, m: int, k: int, n: int, seed: int = 0) -> torch.Tensor:
    """|y - A_r B_r| / (|A_r| |B_r|) elementwise, A_r B_r the float64 product of the model's rounded inputs."""
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    model = get_matmul_model(mode)
    ar, br = round_to(a, model.inputs).double(), round_to(b, model.inputs).double()
    y = matmul(a, b, mode=model).double()
    return (y - ar @ br).abs() / (ar.abs() @ br.abs())


@pytest.mark.parametrize("mode", list(MATMUL_PRESETS))
def test_measured_error_respects_bounds(mode):
    m, k, n = 64, 512, 64
    err = normalized_errors(mode, m, k, n)
    bd = bounds(k, mode)
    assert float(err.max()) <= bd.deterministic
    if bd.probabilistic is not None:
        # all m*n outputs at once with probability >= 1 - 1e-3: per-output confidence 1 - 1e-3 / (m n) (union)
        prob = bounds(k, mode, confidence=1 - 1e-3 / (m * n))
        assert float(err.max()) <= prob.probabilistic
        assert prob.probability == pytest.approx(1 - 1e-3 / (m * n), abs=1e-12)


def test_error_ordering_of_presets():
    # Median |error| vs float64 of the fp16 data, K = 1024, normal inputs. Expected from the bounds' sqrt(n) u
    # scale: fp16/16 ~ sqrt(64) 2**-11 relative, two-stage ~ 2**-11 per MMA + sqrt(64) 2**-24, fp16/32 ~ 2**-24:
    # each ratio is >= 4x by theory, far more in practice; 2x margins cannot be crossed by sampling noise over
    # 16384 outputs.
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(128, 1024, generator=gen).half(), torch.randn(1024, 128, generator=gen).half()
    ref = a.double() @ b.double()
    modes = ("fp16/16", "two_stage", "fp16/32", "bf16/32")
    med = {mode: float((matmul(a, b, mode=mode).double() - ref).abs().median()) for mode in modes}
    assert med["fp16/16"] > 2 * med["two_stage"] > 2 * 2 * med["fp16/32"]
    assert med["bf16/32"] > 2 * med["fp16/32"]  # bf16 inputs lose 3 bits of the fp16 data
    # fp8: accumulation-only error (vs the product of the fp8 inputs): promotion every 128 helps
    acc_err = {
        mode: float(normalized_errors(mode, 32, 1024, 128).max()) for mode in ("fp8/promote128", "fp8/nopromote")
    }
    assert acc_err["fp8/nopromote"] > 2 * acc_err["fp8/promote128"]


def test_bounds_values():
    b16 = bounds(1024, "fp16/16")
    assert b16.n_accumulator_roundings == 64 and b16.n_fp32_roundings == 0
    u = 2.0**-11
    assert b16.deterministic == pytest.approx(64 * u / (1 - 64 * u))
    at_1 = bounds(1024, "fp16/16", lam=1.0)
    assert at_1.probabilistic == pytest.approx(math.expm1(8 * u + 64 * u * u / (1 - u)))
    assert at_1.probability == 0.0  # 2 * 64 * exp(-1/2) > 1: lam = 1 guarantees nothing
    # the default solves lam for 99% per output: 2 * 64 * exp(-lam^2 (1 - u)^2 / 2) = 0.01
    lam = math.sqrt(2 * math.log(2 * 64 / 0.01)) / (1 - u)
    assert b16.lam == pytest.approx(lam) and b16.probability == pytest.approx(0.99)
    assert b16.probabilistic == pytest.approx(math.expm1(lam * 8 * u + 64 * u * u / (1 - u)))
    assert b16.probabilistic < b16.deterministic
    assert bounds(1024, "fp16/16", confidence=0.999).probabilistic > b16.probabilistic
    two = bounds(1024, "two_stage")
    assert two.n_accumulator_roundings == 1 and two.n_fp32_roundings == 64
    assert two.deterministic < b16.deterministic / 30
    assert bounds(4096, "fp8/nopromote").probabilistic is None  # truncation is biased: no sqrt(n) law
    assert bounds(10, "fp16/32").deterministic == pytest.approx(1 * 2.0**-24 / (1 - 2.0**-24))


def test_mode_overrides_and_presets():
    assert get_matmul_model("two_stage").promote_every == 16
    a = torch.randn(4, 64)
    b = torch.randn(64, 3)
    assert torch.equal(
        matmul(a, b, mode="two_stage", promote_every=64),
        matmul(a, b, inputs="fp16", accumulator="fp16", k_group=16, promote_every=64),
    )
    assert torch.equal(matmul(a, b), matmul(a, b, mode="fp16/16"))  # default model is fp16/16


def test_operands_that_require_grad_are_refused_not_silently_detached():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"a requires grad.*EmulatedLinear"):
        matmul(a, b)
    with pytest.raises(ValueError, match="b requires grad"):
        matmul(b.t(), a.t())
    with torch.no_grad():
        assert torch.equal(matmul(a, b), matmul(a.detach(), b))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: matmul(torch.ones(2, 3), torch.ones(4, 2)), ValueError, "agree on K"),
        (lambda: matmul(torch.ones(3), torch.ones(3, 2)), ValueError, "2-D"),
        (lambda: matmul(torch.ones(2, 3, dtype=torch.int64), torch.ones(3, 2)), TypeError, "must have dtype"),
        (lambda: matmul([[1.0]], torch.ones(1, 1)), TypeError, "torch.Tensor"),
        (lambda: matmul(torch.ones(2, 2, 3), torch.ones(3, 3, 2)), ValueError, "broadcast"),
        (lambda: matmul(torch.ones(2, 3), torch.ones(3, 2), mode="fp16/8"), ValueError, "fp16/16"),
        (lambda: matmul(torch.ones(2, 3), torch.ones(3, 2), accumulator="fp12"), ValueError, "accumulator"),
        (lambda: MatmulModel(k_group=0), ValueError, "k_group"),
        (lambda: MatmulModel(k_group=16, promote_every=24), ValueError, "multiple of k_group"),
        (lambda: MatmulModel(align_bits=0), ValueError, "align_bits"),
        (lambda: MatmulModel(align_rounding="up"), ValueError, "align_rounding"),
        (lambda: MatmulModel(inputs=5), TypeError, "inputs"),
        (lambda: bounds(0, "fp16/16"), ValueError, "k"),
        (lambda: bounds(16, "fp16/16", lam=0), ValueError, "lam"),
        (lambda: bounds(16, "fp16/16", lam="1"), TypeError, "lam"),
        (lambda: bounds(16, "fp16/16", confidence=1.0), ValueError, "confidence"),
        (lambda: bounds(16, "fp16/16", confidence="0.9"), TypeError, "confidence"),
        (lambda: bounds(16, "fp16/16", confidence=0.9, lam=2.0), ValueError, "not both"),
        (lambda: bounds(16.0, "fp16/16"), TypeError, "k"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("mode", ["fp16/16", "two_stage", "fp8/promote128"])
def test_empty_contraction_gives_zeros_as_torch_matmul(mode):
    # K = 0: every output is an empty sum, 0, as torch.matmul returns (batched and shared-b shapes too)
    for a, b in [(torch.randn(3, 0), torch.randn(0, 4)), (torch.randn(2, 3, 0), torch.randn(2, 0, 4))]:
        got = matmul(a, b, mode=mode)
        assert got.shape == torch.matmul(a, b).shape and got.dtype == torch.float32
        assert torch.equal(got, torch.zeros_like(got))
    assert matmul(torch.randn(2, 3, 0), torch.randn(0, 5)).shape == (2, 3, 5)
    assert matmul(torch.randn(0, 3), torch.randn(3, 4)).shape == (0, 4)
