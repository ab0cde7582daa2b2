"""mixprec study block-scaling: the error bounds hold (and are nearly attained), floor clips where rceil does
not, exactly as computed by hand, and the printed recommendation follows from the CSV rows."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.cli.main import main
from mixprec.emulate import MX_FORMATS, mx_quantize
from mixprec.lab.studies.base import StudyOutput
from mixprec.lab.studies.block_scaling import (
    BlockScalingConfig,
    clip_kappa,
    format_recommendations,
    measure,
    read_csv,
    recommend,
    run,
)

SMALL = BlockScalingConfig(rows=32, channels=128, model_width=32, model_steps=1)


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    """One run of the whole study at a small size: (printed text, rows read back from its CSV)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("block_scaling")
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert run(SMALL, StudyOutput(out, plot=False)) == 0
    return text.getvalue(), read_csv(out / "block_scaling.csv")


def test_every_configuration_is_within_its_bound(study) -> None:
    _, rows = study
    kinds = {r.kind for r in rows}
    assert kinds == {"normal", "student-t", "outliers", "activations", "gradients"}
    assert len(rows) == 7 * 27  # 3 synthetic + 2 activations + 2 gradients; 5 x 5 E8M0 + 2 NVFP4
    for r in rows:
        key = (r.tensor, r.format, r.mode)
        assert r.err_over_bound <= 1.0, key  # every element within its bound
        assert r.rel_l2 <= r.bound_l2 and r.max_block_rel <= r.max_block_bound, key
        if r.clip_blocks == 0:  # no clipping: within the element's unit roundoff plus the underflow term alone
            u = 2.0 ** -(MX_FORMATS[r.format].element.man_bits + 1)
            assert r.clip_term == 0 and r.rel_l2 <= u + 2**-20 + r.underflow_term, key
        # the per-element bound is nearly attained where nothing underflows much: it is not vacuous
        if r.flushed < 0.2:
            assert r.err_over_bound > 0.5, key
    # the theory of which modes can clip: ceil and neuron never, rceil only by fp32's 2**-24 (not seen here),
    # floor clips beyond rounding on every tensor
    for r in rows:
        if r.mode in ("ceil", "neuron", "rceil"):
            assert r.clip_blocks == 0, (r.tensor, r.format, r.mode)
        if r.mode == "floor":
            assert r.sat_blocks > 0, (r.tensor, r.format)
        # even's largest scaled value stops at the midpoint above M where M tops its binade (all but e4m3, whose
        # 1.875 * 2**8 is NaN), and NVFP4's overshoot (E4M3's 2**-4) stays below 7: their clipping is within rounding
        if (r.mode == "even" and r.format != "mxfp8_e4m3") or r.format == "nvfp4":
            assert r.sat_blocks == 0, (r.tensor, r.format, r.mode)


def test_nvfp4_needs_its_tensor_scale_on_gradients(study) -> None:
    _, rows = study
    by = {(r.tensor, r.mode): r for r in rows if r.format == "nvfp4" and r.kind == "gradients"}
    for (tensor, mode), r in by.items():
        if mode == "e4m3":  # E4M3 block scales stop at 2**-6: gradients of ~1e-4 flush to zero
            assert r.flushed > 0.5 and r.rel_l2 > 0.5, tensor
        else:  # the tensor scale brings them into E4M3's range: an fp4 error again
            assert r.flushed < 0.2 and r.rel_l2 < 0.15, tensor


@pytest.mark.parametrize(
    ("fmt", "big", "floor_value", "rceil_value"),
    [
        # e2m1: E(1.9) = 0, floor scale 2**(0-2), 1.9 / 0.25 = 7.6 > 6 saturates to 6 -> 1.5; rceil: d = 1.9 / 6,
        # ceil(log2 d) = -1, 1.9 / 0.5 = 3.8 rounds to 4 -> 2.0
        ("mxfp4_e2m1", 1.9, 1.5, 2.0),
        # e4m3: E(500) = 8, floor scale 1, 500 > 448 saturates -> 448; rceil: d = 500 / 448, scale 2, 250 rounds
        # to 256 (spacing 16 in [128, 256)) -> 512
        ("mxfp8_e4m3", 500.0, 448.0, 512.0),
    ],
)
def test_floor_clips_where_rceil_does_not(fmt: str, big: float, floor_value: float, rceil_value: float) -> None:
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([big, 0.5, -1.0])  # 0.5 and -1 are on both grids: only `big` errs
    xb = float(x[0, 0])  # big in fp32
    norm = math.sqrt(xb**2 + 0.25 + 1.0)
    floor, rceil = measure(x, fmt, "floor"), measure(x, fmt, "rceil")
    assert floor.clip_blocks == 1.0 and floor.sat_blocks == 1.0
    assert rceil.clip_blocks == 0.0 and rceil.sat_blocks == 0.0
    assert floor.rel_l2 == pytest.approx(abs(xb - floor_value) / norm, rel=1e-12)
    assert rceil.rel_l2 == pytest.approx(abs(rceil_value - xb) / norm, rel=1e-12)
    assert floor.max_block_rel == pytest.approx(abs(xb - floor_value) / xb, rel=1e-12)
    # the clipping term of the bound carries floor's error: 1 - sigma / 2 of |x|
    kappa = clip_kappa(MX_FORMATS[fmt], "floor")
    assert kappa == 1 - (MX_FORMATS[fmt].max_element / 2 ** MX_FORMATS[fmt].emax) / 2
    assert abs(xb - floor_value) <= kappa * xb and floor.err_over_bound <= 1.0
    assert floor.clip_term == pytest.approx(kappa * xb / norm, rel=1e-12)


@pytest.mark.parametrize("fmt", [f for f in MX_FORMATS if f != "nvfp4"])
def test_kappa_is_the_largest_clipping_error(fmt: str) -> None:
    """Sweep the block maximum over a binade (and up to just below 2): the relative error of a clipped element
    never exceeds clip_kappa and comes within 2**-10 of it (floor, even); ceil, neuron and rceil never clip."""
    sig = torch.cat([torch.linspace(1, 2, 4097)[:-1], torch.tensor([2.0]).nextafter(torch.tensor(0.0))])
    sig = torch.cat([sig, sig.nextafter(torch.tensor(2.0))])  # and one ulp above each
    x = torch.zeros(sig.numel(), 32)
    x[:, 0] = sig * 2.0**-3
    bf = MX_FORMATS[fmt]
    for mode in ("floor", "even", "ceil", "neuron", "rceil"):
        q = mx_quantize(x, fmt, scale_mode=mode)
        clipped = x[:, 0].double() > bf.max_element * q.scales[:, 0].double()
        rel = (x[:, 0].double() - q.dequantize()[:, 0].double())[clipped] / x[clipped, 0].double()
        kappa = clip_kappa(bf, mode)
        if kappa == 0 or mode == "rceil":
            assert not bool(clipped.any()), mode
        else:
            assert float(rel.max()) <= kappa and float(rel.max()) > kappa - 2**-10, (mode, float(rel.max()), kappa)


def test_nvfp4_clips_by_at_most_the_e4m3_unit_roundoff() -> None:
    """NVFP4's block scale is amax / 6 rounded to nearest in E4M3: a clipped element loses at most u/(1+u) of
    itself, u = 2**-4 (clip_kappa adds fp32 slack), and never reaches the midpoint 7 (saturation within rounding)."""
    amax = torch.logspace(-1, 3, 20001)  # within E4M3's normal scale range, one level
    x = torch.zeros(amax.numel(), 16)
    x[:, 0] = amax
    q = mx_quantize(x, "nvfp4")
    ratio = x[:, 0].double() / q.scales[:, 0].double()
    clipped = ratio > 6
    rel = 1 - 6 / ratio[clipped]
    assert float(rel.max()) <= clip_kappa(MX_FORMATS["nvfp4"], "e4m3") and float(rel.max()) > 0.058
    assert float(ratio.max()) < 7 and 0.3 < float(clipped.double().mean()) < 0.7


def test_bound_holds_on_special_blocks() -> None:
    """Zeros, fp32 subnormals, blocks too small for E8M0 (rceil decodes them to 0), values above NVFP4's one-level
    range (its E4M3 scale clamps at 448: only |x| bounds the error) and a mixed row."""
    g = torch.Generator().manual_seed(1)
    x = torch.zeros(6, 64)
    x[1] = torch.randn(64, generator=g) * 1e-40  # fp32 subnormals
    x[2] = torch.randn(64, generator=g) * 1e-37
    x[3] = torch.randn(64, generator=g) * 1e4
    x[4] = torch.randn(64, generator=g) * torch.logspace(-30, 30, 64)
    x[5] = torch.randn(64, generator=g)
    config = BlockScalingConfig(rows=1, channels=64)
    for fmt, mode in config.configurations():
        r = measure(x, fmt, mode)
        assert r.err_over_bound <= 1.0 and r.rel_l2 <= r.bound_l2, (fmt, mode)
    one_level = measure(x[3:4], "nvfp4", "e4m3")
    assert one_level.sat_blocks == 1.0 and one_level.rel_l2 > 0.5  # clamped at 448: clipped far beyond rounding


def test_recommendation_follows_from_the_csv_rows(study) -> None:
    text, rows = study
    assert format_recommendations(rows) in text
    for rec in recommend(rows):
        group = [r for r in rows if r.tensor == rec.tensor and r.format == rec.format]
        clean = [r for r in group if r.sat_blocks == 0] or group
        lowest = min(r.rel_l2 for r in clean)
        chosen = next(r for r in group if r.mode == rec.mode)
        assert chosen in clean and chosen.rel_l2 == lowest, (rec.tensor, rec.format)
        assert {r.mode for r in clean if r.rel_l2 == lowest} == {rec.mode, *rec.tied}
    # the rows decide: make the recommended mode of a group saturate and the next clean one takes its place
    rec = next(
        r
        for r in recommend(rows)
        if any(
            o.mode not in (r.mode, *r.tied) and o.sat_blocks == 0
            for o in rows
            if (o.tensor, o.format) == (r.tensor, r.format)
        )
    )
    group = [r for r in rows if (r.tensor, r.format) == (rec.tensor, rec.format)]
    edited = [
        r.__class__(**{**r.__dict__, "sat_blocks": 0.5}) if r in group and r.mode in (rec.mode, *rec.tied) else r
        for r in rows
    ]
    runner_up = min(
        (r for r in group if r.sat_blocks == 0 and r.mode not in (rec.mode, *rec.tied)), key=lambda r: r.rel_l2
    )
    moved = next(r for r in recommend(edited) if (r.tensor, r.format) == (rec.tensor, rec.format))
    assert moved.mode == runner_up.mode


def test_cli_refuses_bad_names_naming_the_argument(capsys) -> None:
    for argv, name in (
        (["--formats", "mxfp9_e4m4"], "--formats"),
        (["--modes", "round"], "--modes"),
        (["--tensors", "weights"], "--tensors"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["study", "block-scaling", *argv])
        assert exc.value.code == 2
        assert name in capsys.readouterr().err
    # names that exist but do not meet: no format takes these modes
    assert main(["study", "block-scaling", "--formats", "nvfp4", "--modes", "floor"]) == 2
    assert "modes" in capsys.readouterr().err


def test_cli_runs(tmp_path, capsys) -> None:
    argv = ["study", "block-scaling", "--rows", "8", "--channels", "64", "--tensors", "outliers"]
    argv += ["--formats", "mxfp4_e2m1,nvfp4", "--no-plot", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| outliers | mxfp4_e2m1 | floor |" in out and "  pick " in out
    assert len(read_csv(tmp_path / "block_scaling.csv")) == 7
