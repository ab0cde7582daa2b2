"""The hierarchical fp32-accumulating collectives on gloo subgroups (2x2, 2x3, 3x2 ranks) against a
single-process reference of the same two-stage order written here: bit for bit, on every rank, twice."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mixprec.comm import all_reduce_fp32_accumulate, reduce_scatter_fp32_accumulate
from mixprec.comm.hierarchical_fp32 import segment_bounds, segment_length
from mixprec.comm.topology import Topology
from mixprec.core.rounding import round_to

SHARD = 37  # odd: segments of unequal length


def rank_input(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(500 + rank)
    return (torch.randn(numel, generator=gen) * torch.exp(2 * torch.randn(numel, generator=gen))).to(dtype)


def _round(x: torch.Tensor, dtype: torch.dtype, rounding: str, gen: torch.Generator | None) -> torch.Tensor:
    if dtype == torch.float32:
        return x.clone()
    if rounding == "nearest":
        return x.to(dtype)
    return round_to(x, dtype, "stochastic", gen).to(dtype)


def _fp32_sum(rows: list[torch.Tensor], divisor: int | None) -> torch.Tensor:
    acc = rows[0].to(torch.float32)
    for row in rows[1:]:
        acc = acc + row.to(torch.float32)  # one fp32 rounding per addend, in order
    return acc / divisor if divisor is not None else acc


def reference(
    inputs: list[torch.Tensor],
    nodes: int,
    per_node: int,
    seg: int,
    *,
    average: bool,
    rounding: str,
    out_dtype: torch.dtype,
    inter_dtype: torch.dtype,
    seeds: list[int] | None,
) -> list[torch.Tensor]:
    """Every rank's reduce-scatter output: node partials summed in local-rank order and rounded to
    ``inter_dtype``, then summed in node order and rounded to ``out_dtype``; the random draws of each rank
    follow the pipeline's order (stage 1 of segment s, then stage 2 of s - 1)."""
    world = nodes * per_node
    shard = inputs[0].numel() // world
    parts = [x.view(world, shard) for x in inputs]  # parts[q][p]: rank q's part p
    gens = [torch.Generator().manual_seed(s) for s in seeds] if seeds else [None] * world
    bounds = segment_bounds(shard, seg)
    outs = [torch.empty(shard, dtype=out_dtype) for _ in range(world)]
    partial: dict[tuple[int, int], torch.Tensor] = {}  # (rank, segment) -> [m, b - a] in inter_dtype

    def stage1(s: int) -> None:
        a, b = bounds[s]
        for rank in range(world):
            i, local = divmod(rank, per_node)
            rows = [
                torch.stack([parts[i * per_node + lq][j * per_node + local][a:b] for j in range(nodes)])
                for lq in range(per_node)
            ]
            p = _fp32_sum(rows, per_node if average else None)
            partial[rank, s] = _round(p.view(-1), inter_dtype, rounding, gens[rank]).view(nodes, b - a)

    def stage2(s: int) -> None:
        a, b = bounds[s]
        for rank in range(world):
            i, local = divmod(rank, per_node)
            rows = [partial[j * per_node + local, s][i] for j in range(nodes)]
            total = _fp32_sum(rows, nodes if average else None)
            outs[rank][a:b] = _round(total, out_dtype, rounding, gens[rank])

    for s in range(len(bounds)):
        stage1(s)
        if s >= 1:
            stage2(s - 1)
    stage2(len(bounds) - 1)
    return outs


CASES = [
    (dtype, average, rounding, inter)
    for dtype in (torch.bfloat16, torch.float16)
    for average in (False, True)
    for rounding in ("nearest", "stochastic")
    for inter in (None, torch.float32)
] + [(torch.float32, average, "nearest", None) for average in (False, True)]  # fp32 wire: the sum order shows


def _run_cases(rank: int, world: int, nodes: int, per_node: int) -> dict[str, object]:
    topo = Topology(nodes, per_node)
    numel = SHARD * world
    results: dict[str, object] = {}
    for dtype, average, rounding, inter in CASES:
        inputs = [rank_input(q, numel, dtype) for q in range(world)]
        inter_dtype = dtype if inter is None else inter
        for area_len in (None, 4 * world * 5):  # default area (4 segments), and segments of 5
            seg = segment_length(SHARD, world, area_len) if area_len else -(-SHARD // 4)
            seg_ar = segment_length(SHARD, world, area_len, nodes, True) if area_len else seg
            name = f"{dtype}-{average}-{rounding}-{inter}-{area_len}"
            seeds = [77 + q for q in range(world)] if rounding == "stochastic" else None
            ref = reference(
                inputs, nodes, per_node, seg, average=average, rounding=rounding, out_dtype=dtype,
                inter_dtype=inter_dtype, seeds=seeds,
            )  # fmt: skip
            for repeat in range(2):
                gen = torch.Generator().manual_seed(77 + rank) if seeds else None
                scratch = None if area_len is None else torch.empty(area_len, dtype=dtype)
                mine = inputs[rank].clone()
                out = torch.empty(SHARD, dtype=dtype)
                reduce_scatter_fp32_accumulate(
                    out, mine, average=average, rounding=rounding, generator=gen, topology=topo,
                    inter_node_dtype=inter, scratch=scratch,
                )  # fmt: skip
                results[f"rs-{name}-{repeat}"] = torch.equal(out, ref[rank]) and torch.equal(mine, inputs[rank])
                gen = torch.Generator().manual_seed(77 + rank) if seeds else None
                scratch = None if area_len is None else torch.empty(area_len, dtype=dtype)
                tensor = inputs[rank].clone()
                pending = all_reduce_fp32_accumulate(
                    tensor, average=average, rounding=rounding, generator=gen, topology=topo,
                    inter_node_dtype=inter, scratch=scratch, async_op=True,
                )  # fmt: skip
                pending.wait()
                # The all-reduce's part r is rank r' = its owner's reduce-scatter result, reordered: local
                # rank l, node i owns slice (l, i) of the [n, m, S] view.
                expected = torch.empty(numel, dtype=dtype).view(per_node, nodes, SHARD)
                ref_ar = reference(
                    [x.view(per_node, nodes, SHARD).transpose(0, 1).reshape(-1) for x in inputs],
                    nodes, per_node, seg_ar, average=average, rounding=rounding, out_dtype=dtype,
                    inter_dtype=inter_dtype, seeds=seeds,
                )  # fmt: skip
                for q in range(world):
                    i, local = divmod(q, per_node)
                    expected[local, i] = ref_ar[q]
                results[f"ar-{name}-{repeat}"] = torch.equal(tensor, expected.view(-1))
    return results


@pytest.mark.parametrize(("nodes", "per_node"), [(2, 2), (2, 3), (3, 2)])
def test_hierarchical_equals_two_stage_reference_bit_for_bit(dist_run, nodes: int, per_node: int) -> None:
    world = nodes * per_node
    results = dist_run(_run_cases, world, nodes, per_node, timeout=180)
    failed = sorted({k for r in results for k, ok in r.items() if not ok})
    assert not failed, failed


def _fp32_output(rank: int, world: int) -> bool:
    """fp32 output (master-gradient shard): the node partial is still rounded to the wire, the end is not."""
    topo = Topology(2, world // 2)
    inputs = [rank_input(q, SHARD * world, torch.bfloat16) for q in range(world)]
    seg = -(-SHARD // 4)
    ref = reference(
        inputs, 2, world // 2, seg, average=True, rounding="nearest", out_dtype=torch.float32,
        inter_dtype=torch.bfloat16, seeds=None,
    )  # fmt: skip
    out = torch.empty(SHARD, dtype=torch.float32)
    reduce_scatter_fp32_accumulate(out, inputs[rank].clone(), average=True, topology=topo)
    return torch.equal(out, ref[rank])


def test_fp32_output_shard(dist_run) -> None:
    assert all(dist_run(_fp32_output, 4))


def _bad_inputs(rank: int, world: int) -> dict[str, str]:
    x = torch.ones(8 * world, dtype=torch.bfloat16)
    errors: dict[str, str] = {}

    def attempt(name: str, fn) -> None:
        try:
            fn()
            errors[name] = "no error"
        except (ValueError, TypeError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"

    attempt("mismatch", lambda: all_reduce_fp32_accumulate(x, topology=Topology(3, 2)))
    attempt("type", lambda: all_reduce_fp32_accumulate(x, topology=(2, 2)))
    odd = torch.ones(6, dtype=torch.bfloat16)
    attempt("indivisible", lambda: all_reduce_fp32_accumulate(odd, topology=Topology(2, 2)))
    attempt("inter", lambda: all_reduce_fp32_accumulate(x, topology=Topology(2, 2), inter_node_dtype=torch.float16))
    attempt("inter-flat", lambda: all_reduce_fp32_accumulate(x, inter_node_dtype=torch.float32))
    attempt(
        "scratch",
        lambda: all_reduce_fp32_accumulate(x, topology=Topology(2, 2), scratch=torch.empty(3, dtype=torch.bfloat16)),
    )
    from torch.distributed.device_mesh import init_device_mesh

    flat_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    attempt("mesh", lambda: all_reduce_fp32_accumulate(x, topology=flat_mesh))
    # Nobody is left waiting: a collective after the refused calls completes on every rank.
    done = torch.ones(1)
    dist.all_reduce(done)
    errors["after"] = str(int(done.item()))
    return errors


def test_bad_input_is_refused_on_every_rank_before_any_collective(dist_run) -> None:
    results = dist_run(_bad_inputs, 4)
    for errors in results:
        assert errors["after"] == "4"
        assert "topology" in errors["mismatch"] and errors["mismatch"].startswith("ValueError")
        assert errors["type"].startswith("TypeError") and "topology" in errors["type"]
        assert "numel" in errors["indivisible"]
        assert "inter_node_dtype" in errors["inter"] and "inter_node_dtype" in errors["inter-flat"]
        assert "scratch" in errors["scratch"]
        assert errors["mesh"].startswith("ValueError") and "DeviceMesh" in errors["mesh"]


def _mesh_topology(rank: int, world: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    inputs = [rank_input(q, SHARD * world, torch.float16) for q in range(world)]
    mine = inputs[rank].clone()
    out_mesh = torch.empty(SHARD, dtype=torch.float16)
    out_topo = torch.empty(SHARD, dtype=torch.float16)
    reduce_scatter_fp32_accumulate(out_mesh, mine, topology=mesh)
    reduce_scatter_fp32_accumulate(out_topo, mine, topology=Topology(2, 2))
    return torch.equal(out_mesh, out_topo)


def test_device_mesh_gives_the_same_bits_as_a_topology(dist_run) -> None:
    assert all(dist_run(_mesh_topology, 4))


@pytest.mark.parametrize(
    ("shard", "seg"), [(37, 10), (37, 5), (1 << 22, 1 << 20), (1 << 20, 1 << 16), (5 << 16, 1 << 16), (8, 2), (1, 4)]
)
def test_segments_cover_the_shard_and_ramp_at_both_ends(shard: int, seg: int) -> None:
    from mixprec.comm.hierarchical_fp32 import RAMP_MIN

    bounds = segment_bounds(shard, seg)
    assert bounds[0][0] == 0 and bounds[-1][1] == shard
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))
    assert all(0 < b - a <= seg for a, b in bounds)  # every segment fits a slot of the area
    lengths = [b - a for a, b in bounds]
    if seg >= RAMP_MIN and shard >= 2 * (seg // 4 + seg // 2) + seg:
        assert lengths[:2] == [seg // 4, seg // 2] and lengths[-2:] == [seg // 2, seg // 4]
    else:  # short segments are latency-bound, short shards cannot ramp: plain segments
        assert lengths == [seg] * (shard // seg) + ([shard % seg] if shard % seg else [])


def _ramped(rank: int, world: int) -> dict[str, bool]:
    """A shard long enough for ramped segments (default area: 4 segments of more than RAMP_MIN elements):
    the pipeline with segments of unequal length still equals the reference, stochastic draws included."""
    from mixprec.comm.hierarchical_fp32 import RAMP_MIN

    nodes, per_node, shard = 2, world // 2, 4 * RAMP_MIN + 7
    seg = -(-shard // 4)
    assert len(segment_bounds(shard, seg)) > 4  # ramped
    topo = Topology(nodes, per_node)
    results = {}
    for dtype, average, rounding, inter in [
        (torch.bfloat16, True, "stochastic", None),
        (torch.float16, False, "nearest", torch.float32),
    ]:
        inputs = [rank_input(q, shard * world, dtype) for q in range(world)]
        inter_dtype = dtype if inter is None else inter
        seeds = [77 + q for q in range(world)] if rounding == "stochastic" else None
        common = {"average": average, "rounding": rounding, "out_dtype": dtype, "inter_dtype": inter_dtype}
        ref = reference(inputs, nodes, per_node, seg, seeds=seeds, **common)
        gen = torch.Generator().manual_seed(77 + rank) if seeds else None
        out = torch.empty(shard, dtype=dtype)
        reduce_scatter_fp32_accumulate(
            out, inputs[rank].clone(), average=average, rounding=rounding, generator=gen, topology=topo,
            inter_node_dtype=inter,
        )  # fmt: skip
        results[f"rs-{dtype}-{rounding}"] = torch.equal(out, ref[rank])
        gen = torch.Generator().manual_seed(77 + rank) if seeds else None
        tensor = inputs[rank].clone()
        all_reduce_fp32_accumulate(
            tensor, average=average, rounding=rounding, generator=gen, topology=topo, inter_node_dtype=inter
        )
        relaid = [x.view(per_node, nodes, shard).transpose(0, 1).reshape(-1) for x in inputs]
        ref_ar = reference(relaid, nodes, per_node, seg, seeds=seeds, **common)
        expected = torch.empty(shard * world, dtype=dtype).view(per_node, nodes, shard)
        for q in range(world):
            i, local = divmod(q, per_node)
            expected[local, i] = ref_ar[q]
        results[f"ar-{dtype}-{rounding}"] = torch.equal(tensor, expected.view(-1))
    return results


def test_ramped_segments_equal_the_reference_bit_for_bit(dist_run) -> None:
    results = dist_run(_ramped, 4, timeout=180)
    failed = sorted({k for r in results for k, ok in r.items() if not ok})
    assert not failed, failed
