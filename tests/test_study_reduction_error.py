"""The reduction-error study: its simulated reductions against scalar references written here, the error
levels error theory predicts, and the CLI."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from mixprec.cli.main import main
from mixprec.lab.studies.reduction_error import (
    ReductionErrorConfig,
    draw_gradients,
    fp32_accumulate_reduce,
    ring_reduce,
    run_study,
    tree_reduce,
)

U16 = 2.0**-11


def _fp16_values(dp: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return draw_gradients(dp, n, distribution="normal", scale=1.0, wire=torch.float16, generator=gen)


def _add_round_fp16(a: np.float16, b: np.float16) -> np.float16:
    """One hop in numpy: widen to float32, add, round to float16 (independent of torch's casts)."""
    return np.float16(np.float32(a) + np.float32(b))


def test_ring_matches_a_scalar_gloo_ring() -> None:
    dp, n = 5, 1300
    g = _fp16_values(dp, n)
    g16 = g.numpy().astype(np.float16)
    # gloo's segmentation of the padded fp16 tensor (1920 elements: a multiple of lcm(5, 128)): S = roundUp(max(
    # ceil(bytes / 1 MiB), 2P), P) segments of ceil(len / S) elements, S / P consecutive ones per chunk.
    padded = 1920
    segments = -(-max(-(-2 * padded // (1 << 20)), 2 * dp) // dp) * dp
    chunk_len = segments // dp * -(-padded // segments)
    expected = np.empty(n, dtype=np.float16)
    for i in range(n):
        chunk = i // chunk_len
        order = [(chunk - 1 - k) % dp for k in range(dp)]  # starts at rank c-1, down the ring, ends at c
        partial = g16[order[0], i]
        for r in order[1:]:
            partial = _add_round_fp16(partial, g16[r, i])
        expected[i] = partial
    assert np.array_equal(ring_reduce(g, torch.float16).numpy().astype(np.float16), expected)


def test_tree_matches_a_scalar_pairwise_sum() -> None:
    dp, n = 6, 9
    g = _fp16_values(dp, n, seed=1)
    g16 = g.numpy().astype(np.float16)

    def pairwise(values: list[np.float16]) -> np.float16:
        while len(values) > 1:
            if len(values) % 2:
                values = [*values, np.float16(0)]
            values = [_add_round_fp16(values[j], values[j + 1]) for j in range(0, len(values), 2)]
        return values[0]

    expected = np.array([pairwise(list(g16[:, i])) for i in range(n)], dtype=np.float16)
    assert np.array_equal(tree_reduce(g, torch.float16).numpy().astype(np.float16), expected)


def test_fp32_accumulate_matches_numpy() -> None:
    g = _fp16_values(7, 50, seed=2)
    acc = np.zeros(50, dtype=np.float32)
    for row in g.numpy():
        acc = acc + row
    assert np.array_equal(fp32_accumulate_reduce(g, torch.float16).numpy(), acc.astype(np.float16).astype(np.float32))
    assert np.array_equal(fp32_accumulate_reduce(g, None).numpy(), acc)


def test_error_levels_follow_error_theory() -> None:
    config = ReductionErrorConfig(dp_sizes=(8, 64), elements=4096, wires=("fp16",), distributions=("normal",))
    rows = {(r.dp, r.method): r for r in run_study(config)}
    # One rounding to nearest: RMS relative error 0.42 u for log-uniform magnitudes (see the study's
    # docstring); 4096 elements put the measured norm ratio within a few percent of it. Flat in DP.
    for dp in (8, 64):
        assert rows[(dp, "fp32_accumulate")].rel_error == pytest.approx(0.4246 * U16, rel=0.1)
    # Rounding at every hop: about sqrt(DP) times worse; at DP 64 well above one rounding.
    assert rows[(64, "ring")].rel_error > 3 * rows[(64, "fp32_accumulate")].rel_error
    assert rows[(64, "ring")].rel_error > 2 * rows[(8, "ring")].rel_error
    # fp16 values with scale 1e-3 are multiples of 2**-24 below 1 in magnitude, and so are their partial
    # sums here: they fit fp32's 24-bit significand, so the fp32 sum is exact.
    assert rows[(64, "fp32_sum_fp32_out")].rel_error == 0.0
    # Stochastic rounding: larger spread than nearest (variance p(1-p) ulp^2 against ulp^2/12)...
    assert rows[(64, "fp32_accumulate_sr")].rel_error > rows[(64, "fp32_accumulate")].rel_error
    assert rows[(64, "fp32_accumulate_sr")].rel_error < 2 * U16


def test_stochastic_variant_is_unbiased_where_nearest_is_not() -> None:
    """Values 1/4 ulp above an fp16 number: nearest rounds them all down (bias -1/4 ulp each); the
    stochastic variant's mean error over M elements is within 5 standard deviations (sqrt(M)/4 ulp in sum)."""
    m = 20_000
    base = torch.full((m,), 1.0)
    ulp = 2.0**-10
    g = torch.stack([base, torch.full((m,), ulp / 4)])  # the fp32 sum is exactly 1 + ulp/4
    sr = fp32_accumulate_reduce(g, torch.float16, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    nearest = fp32_accumulate_reduce(g, torch.float16)
    err_sr = float((sr.double() - (1 + ulp / 4)).sum()) / ulp
    err_nearest = float((nearest.double() - (1 + ulp / 4)).sum()) / ulp
    assert abs(err_sr) < 5 * math.sqrt(m * 0.25 * 0.75)
    assert err_nearest == pytest.approx(-m / 4)


def test_cli_writes_table_csv_and_plot(tmp_path, capsys) -> None:
    code = main(["study", "reduction-error", "--dp", "8,16", "--elements", "256", "--out-dir", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| wire | gradients | DP | ring | tree |" in out
    assert "The published claim (the error table of a public write-up of Megatron-LM's" in out
    assert "Where the measurement disagrees with the published claim:" in out
    with (tmp_path / "reduction_error.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2 * 5  # wires x distributions x DP x methods
    assert {r["method"] for r in rows} == {"ring", "tree", "fp32_accumulate", "fp32_accumulate_sr", "fp32_sum_fp32_out"}
    assert (tmp_path / "reduction_error.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "argv",
    [
        ["--dp", "1"],
        ["--wires", "fp8"],
        ["--distributions", "cauchy"],
    ],
)
def test_cli_bad_arguments_exit_2(argv: list[str], tmp_path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["study", "reduction-error", *argv, "--out-dir", str(tmp_path)])
    assert info.value.code == 2


@pytest.mark.parametrize("argv", [["--elements", "0"], ["--scale", "-1"]])
def test_cli_invalid_config_exits_2(argv: list[str], tmp_path, capsys) -> None:
    assert main(["study", "reduction-error", *argv, "--out-dir", str(tmp_path), "--no-plot"]) == 2
    assert "error:" in capsys.readouterr().err


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="dp_sizes entry"):
        ReductionErrorConfig(dp_sizes=(1,))
    with pytest.raises(ValueError, match="wire"):
        ReductionErrorConfig(wires=("fp8",))
    with pytest.raises(TypeError, match="seed"):
        ReductionErrorConfig(seed=1.5)  # type: ignore[arg-type]
