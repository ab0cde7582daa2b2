"""fingerprint(fn, dtype): the emulator is the ground truth (it must recover each model it is given), torch's CPU
matmul is scored by recomputing the reported bit-equal fraction, results round-trip through JSON, bad input is
refused before any call, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch

from mixprec.cli.main import main
from mixprec.emulate import MATMUL_PRESETS, MatmulModel, matmul
from mixprec.emulate.fingerprints import Fingerprint, fingerprint, load_model, model_from_dict, model_to_dict


def _emulated(model):
    return lambda a, b: matmul(a, b, mode=model)


@pytest.mark.parametrize(
    ("model", "dtype", "expected"),
    [
        (
            "fp16/16",
            torch.float16,
            {"effective_bits": 11, "rounding": "nearest", "k_group": 16, "promote_every": None, "align_bits": None},
        ),
        (
            dataclasses.replace(MATMUL_PRESETS["two_stage"], promote_every=64, name=""),
            torch.float16,
            {"effective_bits": 11, "rounding": "nearest", "k_group": 16, "promote_every": 64, "align_bits": None},
        ),
        (
            "fp8/promote128",
            torch.float8_e4m3fn,
            {"effective_bits": 14, "rounding": "toward_zero", "k_group": 32, "promote_every": 128, "align_bits": 13},
        ),
        (
            "bf16/32",
            torch.bfloat16,
            {"effective_bits": 24, "rounding": "nearest", "k_group": 16, "promote_every": None, "align_bits": None},
        ),
        (
            "fp16/32-h100",
            torch.float16,
            {"effective_bits": 24, "rounding": "toward_zero", "k_group": 16, "promote_every": None, "align_bits": 25},
        ),
        (
            MatmulModel(inputs="fp16", accumulator="fp16", k_group=4, promote_every=32),
            torch.float16,
            {"effective_bits": 11, "rounding": "nearest", "k_group": 4, "promote_every": 32, "align_bits": None},
        ),
    ],
    ids=["fp16/16", "two_stage-64", "fp8/promote128", "bf16/32", "fp16/32-h100", "custom-k4-p32"],
)
def test_recovers_the_emulators_models(model, dtype, expected):
    truth = MATMUL_PRESETS[model] if isinstance(model, str) else model
    fp = fingerprint(_emulated(truth), dtype, m=16, n=16)  # the cost grows with max(m, n); 16 probes per call
    found = {key: getattr(fp, key) for key in expected}
    assert found == expected
    assert fp.products_exact and fp.split_k is None
    assert fp.model == truth  # every field, output included (the emulator returns fp32)
    assert fp.preset == (model if isinstance(model, str) else None)
    assert fp.bit_equal == 1.0 and fp.probe_agreement == 1.0


def test_split_k_scales_with_k():
    def split_in_four(a, b):  # fp16 MMAs, each quarter of K accumulated on its own, quarters added in fp32
        k = a.shape[1]
        return matmul(a, b, mode=MatmulModel(inputs="fp16", accumulator="fp16", k_group=16, promote_every=k // 4))

    fp = fingerprint(split_in_four, torch.float16, m=16, n=16, k=1024)
    assert (fp.split_k, fp.promote_every, fp.k_group) == (4, 256, 16)
    assert fp.bit_equal == 1.0


def test_rounded_products_are_reported():
    """A BLAS without FMA rounds each fp32 product before adding it (MKL's SSE2 branch, MKL_CBWR=COMPATIBLE, or
    an x86-64 CPU without FMA): the fingerprint must say so rather than claim exact products."""

    def no_fma(a, b):  # each product rounded to fp32, then an fp32 chain in K order
        products = a.unsqueeze(2) * b.unsqueeze(0)
        acc = torch.zeros(a.shape[0], b.shape[1])
        for j in range(a.shape[1]):
            acc = acc + products[:, j, :]
        return acc

    fp = fingerprint(no_fma, torch.float32, m=16, n=16)
    assert not fp.products_exact and "products ROUNDED" in fp.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_torch_cpu_matmul_report_is_what_the_model_gives(dtype):
    """What holds on any x86-64 CPU: the report scores its model by what the model gives on the same operands.
    How torch's CPU matmul accumulates is the CPU's (MKL picks its kernel and blocking by CPU: promotion every 256
    products on the Intel Xeons, every 192 on an AMD EPYC, products rounded on its SSE2 branch), so no blocking is
    asserted, and the claim that the model reproduces it is made where the family covers it (exact products)."""
    fp = fingerprint(torch.matmul, dtype, seed=3)
    assert fp.inputs == {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    assert fp.output == fp.inputs  # torch's CPU matmul returns its input dtype
    if dtype != torch.float32:
        assert fp.products_exact  # 8- or 11-bit significands: their products fit fp32's 24 bits, FMA or not
    # recompute the bit-equal fraction from the same operands (an independent call of both sides)
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(fp.m, fp.k, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(fp.k, fp.n, generator=gen, dtype=torch.float64).to(dtype)
    real = torch.matmul(a, b).double()
    emulated = matmul(a, b, mode=fp.model).double()
    assert fp.bit_equal == float((real == emulated).double().mean())
    for name, score in fp.preset_bit_equal.items():
        preset = dataclasses.replace(MATMUL_PRESETS[name], output=fp.model.output)
        assert score == float((real == matmul(a, b, mode=preset).double()).double().mean())
    if dtype == torch.float32:
        if fp.products_exact:
            # products enter an fp32 chain exactly (FMA), nothing else rounds: the model reproduces MKL's blocking
            assert fp.effective_bits == 24 and fp.rounding == "nearest"
            assert fp.bit_equal >= 0.99
        else:  # rounded products lie outside the model family (test_rounded_products_are_reported)
            assert "products ROUNDED" in fp.summary()
    else:
        assert fp.bit_equal >= 0.9  # fp32 accumulation rounded once to the output: even fp16/32 is this close


def test_save_load_round_trip(tmp_path):
    fp = fingerprint(_emulated("fp16/16"), torch.float16, m=16, n=16)
    path = fp.save(tmp_path / "fp.json")
    back = Fingerprint.load(path)
    assert back == fp and back.model == MATMUL_PRESETS["fp16/16"] and back.model.name == "fp16/16"
    assert load_model(path) == fp.model
    custom = MatmulModel(inputs="bf16", accumulator="tf32", k_group=8, promote_every=64, output="bf16")
    assert model_from_dict(model_to_dict(custom)) == custom
    odd = dataclasses.replace(custom, accumulator=custom.accumulator.__class__(8, 13))
    assert model_to_dict(odd)["accumulator"]["man_bits"] == 13 and model_from_dict(model_to_dict(odd)) == odd
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a matmul fingerprint"):
        Fingerprint.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match="cannot read"):
        Fingerprint.load(tmp_path / "missing.json")


@pytest.fixture(scope="module")
def probed_fp16():
    return fingerprint(_emulated("fp16/16"), torch.float16, m=16, n=16)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("k_group", 2**29, ValueError),
        ("k_group", 0, ValueError),
        ("k_group", 258, ValueError),
        ("k_group", 16.0, TypeError),
        ("promote_every", 1024, ValueError),  # the promotion scans stop below 2 k
        ("split_k", 513, ValueError),
        ("effective_bits", 31, ValueError),
        ("align_bits", 30, ValueError),
        ("k", 511, ValueError),
        ("m", 1, ValueError),
        ("bit_equal", 1.5, ValueError),
        ("rounding", "up", ValueError),
        ("products_exact", 1, TypeError),
    ],
)
def test_loaded_fields_lie_in_the_probes_range(tmp_path, probed_fp16, field, value, error):
    """A file may hold only what fingerprint() can report: k_group = 2**29 made one training step of a 23k-parameter
    model run for over 600 s (every group padded to 2**29 products)."""
    fp = probed_fp16
    data = fp.to_dict()
    assert Fingerprint.from_dict(dict(data)) == fp  # the probe's own result lies in the ranges
    path = tmp_path / "fp.json"
    path.write_text(json.dumps({"format": "mixprec-matmul-fingerprint", "version": 1, **data, field: value}))
    with pytest.raises(error, match=f"{re.escape(repr(str(path)))}: fingerprint field {field} must"):
        Fingerprint.load(path)
    model = {**data["model"], "k_group": value} if field == "k_group" else None
    if model is not None and error is ValueError and value > 0:
        with pytest.raises(ValueError, match=re.escape("fingerprint field model.k_group must be in 1..257")):
            Fingerprint.from_dict({**data, "model": model})


def test_load_refuses_a_fifo_and_deep_json(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):  # open() would block: nothing writes to it
        load_model(fifo)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="JSON nested too deeply"):
        load_model(tmp_path / "deep.json")


def test_bad_input_refused_before_any_call():
    calls = []

    def fn(a, b):
        calls.append(1)
        return a.float() @ b.float()

    with pytest.raises(TypeError, match="fn must be callable"):
        fingerprint("matmul", torch.float16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        fingerprint(fn, torch.float64)
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        fingerprint(fn, "fp16")
    with pytest.raises(ValueError, match="k must be an int >= 512"):
        fingerprint(fn, torch.float16, k=256)
    assert not calls
    with pytest.raises(ValueError, match="must return shape"):
        fingerprint(lambda a, b: (a.float() @ b.float())[:1], torch.float16)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtypes", "fp64"], "unknown dtype 'fp64'"),
        (["--dtypes", "fp8_e4m3"], "needs --device cuda"),
        (["--fn", "emulate:fp4"], "emulate:PRESET needs one of"),
        (["--shape", "64,64"], "--shape must be M,N,K"),
        (["--shape", "64,64,128"], "K >= 512"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(argv, message, capsys):
    assert main(["probe", "matmul", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err


def test_cli_probes_the_emulator_and_saves(capsys, tmp_path):
    argv = ["probe", "matmul", "--fn", "emulate:fp16/16", "--dtypes", "fp16", "--save", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "model: fp16/16 (fp16/16); bit-equal 100.0% on random data" in out
    assert load_model(tmp_path / "matmul_fp16.json") == MATMUL_PRESETS["fp16/16"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cublas_and_scaled_mm_on_gpu():
    for dtype in (torch.float16, torch.bfloat16):
        fp = fingerprint(torch.matmul, dtype, device="cuda", label="cuBLAS")
        print(fp.summary())
        assert fp.products_exact and fp.bit_equal > 0.5
    if torch.cuda.get_device_capability() >= (9, 0):
        one = torch.ones((), device="cuda")

        def scaled_mm(a, b):
            return torch._scaled_mm(a, b.t().contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32)

        fp = fingerprint(scaled_mm, torch.float8_e4m3fn, device="cuda", label="torch._scaled_mm")
        print(fp.summary())
        assert fp.inputs == "fp8_e4m3" and fp.bit_equal > 0.5
