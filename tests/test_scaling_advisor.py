"""The loss-scale advisor, DP rescaling, the gradient-range report, and the check-config CLI."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.cli.main import main
from mixprec.scaling import GradientStats, advise, grad_range_by_layer, grad_range_report, rescale_for_dp


def codes(advice):
    return [f.code for f in advice.findings if f.severity != "info"]


def test_consistent_configuration():
    a = advise(1024, 4, 64, 256)
    assert a.num_microbatches == 4 and a.effective_scale == 64 and a.ok and codes(a) == []


def test_gbs_not_divisible():
    a = advise(1000, 4, 64, 256)
    assert not a.ok and codes(a) == ["gbs-not-divisible"] and a.num_microbatches is None
    assert "768 or 1024" in a.findings[0].message


def test_scale_below_microbatches_shrinks_gradients():
    a = advise(4096, 1, 16, 128)  # 256 microbatches, scale 128 -> factor 0.5
    assert codes(a) == ["scale-below-microbatches"] and a.suggested_loss_scale == 256


def test_scale_not_power_of_two_multiple():
    a = advise(1024, 4, 64, 12)  # factor 3
    assert codes(a) == ["scale-not-pow2-multiple"] and a.suggested_loss_scale == 16
    assert advise(1024, 4, 64, 4).ok  # factor 1 = 2**0 is fine


def test_rescale_for_dp_keeps_ratio():
    gbs, mbs = 2048, 2
    for old, new in [(64, 128), (128, 32), (8, 8), (16, 256)]:
        ls = 512.0
        new_ls = rescale_for_dp(ls, old, new)
        a_old, a_new = advise(gbs, mbs, old, ls), advise(gbs, mbs, new, new_ls)
        assert a_old.effective_scale == a_new.effective_scale
    assert rescale_for_dp(256, 64, 128) == 128  # DP up 2x -> loss scale down 2x


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((0, 4, 64, 256), ValueError, "global_batch_size"),
        ((1024, 4.0, 64, 256), TypeError, "micro_batch_size"),
        ((1024, 4, -1, 256), ValueError, "data_parallel_size"),
        ((1024, 4, 64, 0), ValueError, "loss_scale"),
        ((1024, 4, 64, float("nan")), ValueError, "loss_scale"),
    ],
)
def test_advise_invalid(args, exc, match):
    with pytest.raises(exc, match=match):
        advise(*args)


def test_rescale_invalid():
    with pytest.raises(ValueError, match="new_dp"):
        rescale_for_dp(256, 64, 0)


# ------------------------------------------------------------------------------- CLI exit codes
def test_check_config_cli_exit_codes(capsys):
    base = ["check-config", "--global-batch-size", "1024", "--micro-batch-size", "4", "--dp", "64"]
    assert main([*base, "--loss-scale", "256"]) == 0
    assert "OK: consistent" in capsys.readouterr().out
    assert main([*base, "--loss-scale", "2"]) == 1  # below num_microbatches
    assert main([*base, "--loss-scale", "256", "--new-dp", "128"]) == 0
    out = capsys.readouterr().out
    assert "loss_scale = 256 x 64 / 128 = 128" in out
    assert main([*base, "--loss-scale", "256", "--new-dp", "3"]) == 1  # 1024 not divisible by 4 x 3
    assert main([*base, "--loss-scale", "-1"]) == 2
    assert "loss_scale" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main([*base, "--loss-scale", "abc"])
    assert info.value.code == 2


# ------------------------------------------------------------------------------- gradient range
def test_grad_range_report_exact_on_crafted_values():
    tiny_sub = 2.0**-24  # smallest fp16 subnormal
    g = torch.tensor(
        [
            0.0,  # zero
            tiny_sub / 4,  # below half the smallest subnormal -> 0 at scale 1
            tiny_sub * 3,  # subnormal
            1.0,  # normal
            70000.0,  # > 65504 + half spacing -> inf
            float("nan"),
            float("inf"),
            65519.0,  # rounds down to 65504 (normal)
        ]
    )
    r = grad_range_report([g], scale=1.0)
    n = 8
    assert (r.zero, r.underflow, r.subnormal, r.normal, r.overflow, r.nonfinite) == (
        1 / n,
        1 / n,
        1 / n,
        2 / n,
        1 / n,
        2 / n,
    )
    # scaling by 2**10 lifts the tiny value into the subnormals and the subnormal into the normals,
    # and pushes 1.0 * 1024 still normal, 65519 * 1024 to inf
    r2 = grad_range_report([g], scale=1024.0)
    assert (r2.underflow, r2.subnormal, r2.normal, r2.overflow) == (0.0, 1 / n, 2 / n, 2 / n)
    assert math.isclose(r.zero + r.underflow + r.subnormal + r.normal + r.overflow + r.nonfinite, 1.0)


def _fp16_class_by_thresholds(y: torch.Tensor) -> dict[str, int]:
    """Independent oracle: classify fp64 values by where round-to-nearest-even to fp16 sends them.

    Smallest subnormal 2**-24: |y| <= 2**-25 rounds to 0 (the tie at 2**-25 goes to the even 0). The largest
    subnormal is 2**-14 - 2**-24: |y| >= 2**-14 - 2**-25 rounds up to the smallest normal (the tie goes to the
    even 2**-14). The largest finite is 65504 with spacing 32: |y| >= 65520 rounds to inf (the tie goes up).
    """
    a = y.abs()
    nz = y != 0
    return {
        "underflow": int((nz & (a <= 2.0**-25)).sum()),
        "subnormal": int(((a > 2.0**-25) & (a < 2.0**-14 - 2.0**-25)).sum()),
        "normal": int(((a >= 2.0**-14 - 2.0**-25) & (a < 65520)).sum()),
        "overflow": int((a >= 65520).sum()),
    }


@pytest.mark.parametrize("scale", [1.0, 2.0**8, 2.0**16, 3.0, 1000.0])
def test_grad_range_report_matches_threshold_oracle(scale):
    torch.manual_seed(0)
    g = torch.randn(200_000) * torch.exp2(torch.randint(-40, 5, (200_000,)).float())
    g[:6] = torch.tensor([2.0**-25, 2.0**-14 - 2.0**-25, 65520.0, 65519.0, 2.0**-14 - 2.0**-24, 3 * 2.0**-26]) / scale
    r = grad_range_report([g], scale)
    # the report's model: the product formed in fp32, then rounded once to fp16
    y = (g * scale).double()  # g * scale in fp32 (both operands fp32), widened exactly
    expected = _fp16_class_by_thresholds(y)
    for field, count in expected.items():
        assert round(getattr(r, field) * r.count) == count, field
    assert expected["underflow"] > 0 and expected["subnormal"] > 0 and expected["normal"] > 0


def test_gradient_stats_approximates_exact_report_within_a_binade():
    torch.manual_seed(0)
    g = torch.randn(200_000) * torch.exp2(torch.empty(200_000).uniform_(-38, 4))  # log-uniform magnitudes
    stats = GradientStats.from_tensors([g[:100_000]]).merge(GradientStats.from_tensors([g[100_000:]]))
    for scale in (1.0, 2.0**10, 2.0**20):
        exact, approx = grad_range_report([g], scale), stats.report(scale)
        # magnitudes are log-uniform over 42 binades, so a misclassified binade is ~1/42 of the mass
        for field in ("underflow", "subnormal", "normal", "overflow"):
            assert abs(getattr(exact, field) - getattr(approx, field)) <= 1.5 / 42, (scale, field)


def test_grad_range_invalid():
    with pytest.raises(ValueError, match="dtype"):
        grad_range_report([torch.ones(2)], 1.0, dtype=torch.float32)
    with pytest.raises(ValueError, match="scale"):
        grad_range_report([torch.ones(2)], 0.0)
    with pytest.raises(TypeError, match="floating-point"):
        grad_range_report([torch.ones(2, dtype=torch.int32)], 1.0)


def test_grad_range_by_layer_is_the_report_of_each_layers_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2, bias=False))
    model[0].weight.grad = torch.randn(8, 4) * 1e-6
    model[0].bias.grad = torch.full((8,), 3e4)
    model[2].weight.grad = torch.randn(2, 8)
    layers = grad_range_by_layer(model, 4.0)
    assert list(layers) == ["0", "2"]
    assert layers["0"] == grad_range_report([model[0].weight.grad, model[0].bias.grad], 4.0)
    assert layers["0"].overflow == pytest.approx(8 / 40) and layers["2"].overflow == 0.0
    per_param = grad_range_by_layer(model.named_parameters(), 4.0, per="parameter")
    assert list(per_param) == ["0.weight", "0.bias", "2.weight"]
    assert per_param["0.bias"].overflow == 1.0
    model[2].weight.grad = None
    assert list(grad_range_by_layer(model, 4.0)) == ["0"]
    with pytest.raises(ValueError, match="per"):
        grad_range_by_layer(model, 4.0, per="layer")
    with pytest.raises(TypeError, match="named"):
        grad_range_by_layer(torch.zeros(3), 4.0)
