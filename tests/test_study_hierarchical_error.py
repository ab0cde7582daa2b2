"""The hierarchical rows of the reduction-error study: the simulated two-stage sum against a numpy reference,
the RMS levels error theory predicts (two roundings, flat in DP) and the worst-case bound of the docstring."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mixprec.cli.main import main
from mixprec.lab.studies.reduction_error import (
    ReductionErrorConfig,
    draw_gradients,
    exact_sum,
    hierarchical_reduce,
    run_study,
)

U16 = 2.0**-11
U32 = 2.0**-24


def gamma(k: int) -> float:
    return k * U32 / (1 - k * U32)


def _values(dp: int, n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return draw_gradients(dp, n, distribution="student-t", scale=1.0, wire=torch.float16, generator=gen)


def test_two_stage_sum_matches_numpy() -> None:
    g = _values(12, 17)
    x = g.numpy()
    for fp32_inter in (False, True):
        partials = []
        for node in range(3):
            acc = np.float32(0) + x[node * 4]
            for local in range(1, 4):
                acc = acc + x[node * 4 + local]  # float32 + float32: one IEEE rounding
            partials.append(acc if fp32_inter else acc.astype(np.float16).astype(np.float32))
        total = partials[0] + partials[1] + partials[2]
        expected = total.astype(np.float16).astype(np.float32)
        got = hierarchical_reduce(g, torch.float16, 4, fp32_inter=fp32_inter).numpy()
        assert np.array_equal(got, expected)


def test_rms_error_is_two_roundings_flat_in_dp() -> None:
    config = ReductionErrorConfig(dp_sizes=(64, 512), elements=4096, wires=("fp16",), distributions=("normal",))
    rows = {(r.dp, r.method): r.rel_error for r in run_study(config)}
    for dp in (64, 512):
        # Node partials rounded once (0.42 u RMS of each, adding up like the sum itself), then the result
        # rounded once more: sqrt(2) x 0.4246 u, whatever the number of nodes.
        assert rows[(dp, "hierarchical")] == pytest.approx(math.sqrt(2) * 0.4246 * U16, rel=0.1)
        # fp32 across nodes: one rounding, the flat scheme's level.
        assert rows[(dp, "hierarchical_fp32_inter")] == pytest.approx(0.4246 * U16, rel=0.1)
    assert rows[(512, "ring")] > 5 * rows[(512, "hierarchical")]


@pytest.mark.parametrize(("nodes", "per_node"), [(4, 8), (64, 8), (16, 3)])
def test_worst_case_bound_holds_element_wise(nodes: int, per_node: int) -> None:
    g = _values(nodes * per_node, 2048, seed=nodes)
    s = exact_sum(g)
    abs_sum = exact_sum(g.abs())
    for fp32_inter, u_inter in ((False, U16), (True, 0.0)):
        err = (hierarchical_reduce(g, torch.float16, per_node, fp32_inter=fp32_inter).double() - s).abs()
        # First order: u |s| + (u_inter + gamma_{m-1} + gamma_{n-1}) sum |x|; the factor (1 + 4 u) covers
        # the second-order products of these terms.
        bound = (U16 * s.abs() + (u_inter + gamma(nodes - 1) + gamma(per_node - 1)) * abs_sum) * (1 + 4 * U16)
        assert bool((err <= bound).all())


def test_cli_prints_the_hierarchical_table(tmp_path, capsys) -> None:
    argv = ["study", "reduction-error", "--dp", "16,32", "--elements", "256", "--no-plot", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Hierarchical (8 ranks per node)" in out
    assert (tmp_path / "reduction_error_hierarchical.csv").exists()
