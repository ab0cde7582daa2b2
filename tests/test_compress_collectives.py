"""compressed_all_reduce / compressed_reduce_scatter on 2, 3, 4 gloo ranks and 2 nodes x 2: bit-for-bit
equal to the independent single-process reference (tests/compress_reference.py), within the quantization
bound of the exact mean, wire bytes, error feedback over many steps, non-finite inputs, bad arguments.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from compress_reference import (
    U32,
    call_randoms,
    quantizer_bound,
    ref_flat_all_reduce,
    ref_flat_reduce,
    ref_hierarchical_all_reduce,
    ref_hierarchical_reduce_scatter,
)
from mixprec.comm import Topology
from mixprec.compress import (
    CompressedReducer,
    ErrorFeedback,
    MinMaxUInt8,
    NonFiniteError,
    compressed_all_reduce,
    compressed_reduce_scatter,
    start_compressed_all_reduce,
    start_compressed_reduce_scatter,
)
from mixprec.compress.state import CompressionWorkspace

CHUNK = 256
N = 12 * 1024  # divisible by 2, 3 and 4; parts of 6144/4096/3072 elements: whole and partial chunks


def _input(rank: int, n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    # Per-rank scale and offset, and a wide-range tail: chunks differ in range from rank to rank.
    x = torch.randn(n, generator=g) * (rank + 1) + 0.3 * rank
    x[-700:] *= torch.logspace(-3, 3, 700)
    return x


def _inputs(world: int, n: int = N, seed: int = 0) -> list[np.ndarray]:
    return [_input(r, n, seed).numpy() for r in range(world)]


def _scheme_bound(quantized: list[np.ndarray], chunk_id: np.ndarray, divisor: int, adds: int) -> np.ndarray:
    """|result - exact mean| bound for a scheme that quantizes each vector of ``quantized`` (chunked by
    ``chunk_id``), sums the decoded vectors in fp32 (``adds`` roundings, each <= u * sum of |terms|),
    divides by ``divisor`` (one more u), then quantizes the result once more on the same chunks.
    """
    ids = np.unique(chunk_id)
    worker = np.zeros(chunk_id.size)
    absum = np.zeros(chunk_id.size)
    for v in quantized:
        v = v.astype(np.float64)
        for i in ids:
            m = chunk_id == i
            worker[m] += quantizer_bound(np.ptp(v[m]), np.abs(v[m]).max()) / divisor
        absum += np.abs(v)
    # |decoded| <= |v| + its error; gamma_adds + one division, rounded up generously (u^2 terms).
    summing = (adds + 1.01) * U32 * (absum / divisor + worker)
    exact = np.sum([v.astype(np.float64) for v in quantized], axis=0) / divisor
    before_server = worker + summing
    server = np.zeros(chunk_id.size)
    for i in ids:
        m = chunk_id == i
        slack = before_server[m].max()
        server[m] = quantizer_bound(np.ptp(exact[m]) + 2 * slack, np.abs(exact[m]).max() + slack)
    return before_server + server


def _flat_chunk_ids(n: int, world: int, chunk: int) -> np.ndarray:
    e = np.arange(n)
    part = n // world
    return (e // part) * (part // chunk + 1) + (e % part) // chunk


def _hier_chunk_ids(n: int, nodes: int, per_node: int, chunk: int) -> np.ndarray:
    e = np.arange(n)
    sl = n // per_node
    part = sl // nodes
    return (e // part) * (part // chunk + 1) + (e % part) // chunk  # slices split evenly into node parts


# ---------------------------------------------------------------------------------------------- workers
def monkeypatch_segment(elements: int) -> None:
    import mixprec.compress.flat as flat

    flat._SEGMENT_ELEMENTS = elements  # inside a forked rank only


def _worker_main(rank: int, world: int, topology: Topology | None, segment: int | None = None) -> dict:
    if segment is not None:  # many pipeline segments: results must not change by a single bit
        monkeypatch_segment(segment)
    comp = MinMaxUInt8(chunk_size=CHUNK)
    out: dict = {}
    x = _input(rank)
    out["all_reduce"] = x
    out["stats"] = compressed_all_reduce(x, compressor=comp, topology=topology)
    shard = torch.empty(N // world)
    out["rs_stats"] = compressed_reduce_scatter(shard, _input(rank), compressor=comp, topology=topology)
    out["reduce_scatter"] = shard
    s = _input(rank, seed=1)
    compressed_all_reduce(s, compressor=comp, topology=topology, average=False)
    out["sum"] = s
    # Stochastic rounding, each rank with its own stream.
    g = torch.Generator().manual_seed(500 + rank)
    st = _input(rank, seed=2)
    stochastic = MinMaxUInt8(chunk_size=CHUNK, rounding="stochastic", generator=g)
    compressed_all_reduce(st, compressor=stochastic, topology=topology)
    out["stochastic"] = st
    # bf16 in and out, and a size that is not a multiple of the world size (zero-padded).
    b = _input(rank, seed=3).bfloat16()
    compressed_all_reduce(b, compressor=comp, topology=topology)
    out["bf16"] = b
    odd = _input(rank, n=N + 1, seed=4)[: N - 5].view(-1, 1)[::1]
    compressed_all_reduce(odd, compressor=comp, topology=topology)
    out["odd"] = odd
    # Error feedback over a few steps, bit for bit.
    ef = ErrorFeedback()
    steps = []
    for t in range(3):
        v = _input(rank, seed=10 + t)
        compressed_all_reduce(v, compressor=comp, error_feedback=ef, topology=topology)
        steps.append(v)
    out["ef_steps"] = steps
    out["ef_state"] = ef.state_dict()
    return out


@pytest.mark.parametrize("world, segment", [(2, None), (3, None), (4, None), (2, 700), (3, 700)])
def test_flat_bit_for_bit_against_reference(dist_run, world: int, segment: int | None) -> None:
    # segment=700: one or two chunks of 256 per rank per pipeline segment, 12-16 segments per call
    results = dist_run(_worker_main, world, None, segment, timeout=120)
    part = N // world

    ref, flagged = ref_flat_all_reduce(_inputs(world), CHUNK)
    assert not flagged
    for r in range(world):
        np.testing.assert_array_equal(results[r]["all_reduce"].numpy(), ref[0])
        assert results[r]["stats"] == results[0]["stats"]
    shards = ref_flat_reduce(_inputs(world), CHUNK, divisor=world)
    for r in range(world):
        np.testing.assert_array_equal(results[r]["reduce_scatter"].numpy(), shards[r])
    ref_sum, _ = ref_flat_all_reduce(_inputs(world, seed=1), CHUNK, average=False)
    np.testing.assert_array_equal(results[world - 1]["sum"].numpy(), ref_sum[0])

    gens = [torch.Generator().manual_seed(500 + r) for r in range(world)]
    randoms = [call_randoms(g, N, part) for g in gens]
    ref_st, _ = ref_flat_all_reduce(_inputs(world, seed=2), CHUNK, rounding="stochastic", randoms=randoms)
    for r in range(world):
        np.testing.assert_array_equal(results[r]["stochastic"].numpy(), ref_st[0])

    bf16_inputs = [_input(r, seed=3).bfloat16().float().numpy() for r in range(world)]
    ref_bf16, _ = ref_flat_all_reduce(bf16_inputs, CHUNK)
    assert torch.equal(results[0]["bf16"], torch.from_numpy(ref_bf16[0]).bfloat16())

    padded = -(-(N - 5) // world) * world
    odd_inputs = [
        np.concatenate([_input(r, n=N + 1, seed=4)[: N - 5].numpy(), np.zeros(padded - N + 5, np.float32)])
        for r in range(world)
    ]
    ref_odd, _ = ref_flat_all_reduce(odd_inputs, CHUNK)
    assert results[1]["odd"].shape == (N - 5, 1)
    np.testing.assert_array_equal(results[1]["odd"].view(-1).numpy(), ref_odd[0][: N - 5])

    residuals = {"worker": [np.zeros(N, np.float32)] * world, "server": [np.zeros(part, np.float32)] * world}
    residuals = {k: list(v) for k, v in residuals.items()}
    for t in range(3):
        ref_t, _ = ref_flat_all_reduce(_inputs(world, seed=10 + t), CHUNK, residuals=residuals)
        for r in range(world):
            np.testing.assert_array_equal(results[r]["ef_steps"][t].numpy(), ref_t[0])
    for r in range(world):
        np.testing.assert_array_equal(results[r]["ef_state"]["worker"].numpy(), residuals["worker"][r])
        np.testing.assert_array_equal(results[r]["ef_state"]["server"].numpy(), residuals["server"][r])


def test_hierarchical_2x2_bit_for_bit_and_within_bound(dist_run) -> None:
    flat = dist_run(_worker_main, 4, None, timeout=120)
    hier = dist_run(_worker_main, 4, Topology(2, 2), 700, timeout=120)
    inputs = _inputs(4)
    ref = ref_hierarchical_all_reduce(inputs, CHUNK, 2, 2)
    for r in range(4):
        np.testing.assert_array_equal(hier[r]["all_reduce"].numpy(), ref[0])
    shards = ref_hierarchical_reduce_scatter(inputs, CHUNK, 2, 2)
    for r in range(4):
        np.testing.assert_array_equal(hier[r]["reduce_scatter"].numpy(), shards[r])
    ref_sum = ref_hierarchical_all_reduce(_inputs(4, seed=1), CHUNK, 2, 2, average=False)
    np.testing.assert_array_equal(hier[2]["sum"].numpy(), ref_sum[0])

    # Stochastic rounding, bf16, zero padding and error feedback, bit for bit in the hierarchical scheme too.
    # Rank r draws one key; its node slice (N / 2 elements) takes positions [0, N / 2), its part of it the next N / 4.
    gens = [torch.Generator().manual_seed(500 + r) for r in range(4)]
    randoms = [call_randoms(g, N // 2, N // 4) for g in gens]
    ref_st = ref_hierarchical_all_reduce(_inputs(4, seed=2), CHUNK, 2, 2, rounding="stochastic", randoms=randoms)
    bf16_inputs = [_input(r, seed=3).bfloat16().float().numpy() for r in range(4)]
    ref_bf16 = torch.from_numpy(ref_hierarchical_all_reduce(bf16_inputs, CHUNK, 2, 2)[0]).bfloat16()
    padded = -(-(N - 5) // 4) * 4
    odd_inputs = [
        np.concatenate([_input(r, n=N + 1, seed=4)[: N - 5].numpy(), np.zeros(padded - N + 5, np.float32)])
        for r in range(4)
    ]
    ref_odd = ref_hierarchical_all_reduce(odd_inputs, CHUNK, 2, 2)[0][: N - 5]
    residuals = {"worker": [np.zeros(N // 2, np.float32)] * 4, "server": [np.zeros(N // 4, np.float32)] * 4}
    residuals = {k: list(v) for k, v in residuals.items()}
    ref_ef = [
        ref_hierarchical_all_reduce(_inputs(4, seed=10 + t), CHUNK, 2, 2, residuals=residuals)[0] for t in range(3)
    ]
    for r in range(4):
        np.testing.assert_array_equal(hier[r]["stochastic"].numpy(), ref_st[0])
        assert torch.equal(hier[r]["bf16"], ref_bf16)
        np.testing.assert_array_equal(hier[r]["odd"].view(-1).numpy(), ref_odd)
        for t in range(3):
            np.testing.assert_array_equal(hier[r]["ef_steps"][t].numpy(), ref_ef[t])
        np.testing.assert_array_equal(hier[r]["ef_state"]["worker"].numpy(), residuals["worker"][r])
        np.testing.assert_array_equal(hier[r]["ef_state"]["server"].numpy(), residuals["server"][r])
    assert not np.array_equal(ref_st[0], ref_hierarchical_all_reduce(_inputs(4, seed=2), CHUNK, 2, 2)[0])

    # Both schemes within their quantization bounds of the exact mean, hence of each other.
    exact = np.mean([x.astype(np.float64) for x in inputs], axis=0)
    flat_bound = _scheme_bound(inputs, _flat_chunk_ids(N, 4, CHUNK), 4, adds=3)
    node_sums = [inputs[0] + inputs[1], inputs[2] + inputs[3]]  # fp32 node sums; their rounding: 1 more add
    hier_bound = _scheme_bound(node_sums, _hier_chunk_ids(N, 2, 2, CHUNK), 4, adds=2)
    flat_err = np.abs(flat[0]["all_reduce"].numpy() - exact)
    hier_err = np.abs(hier[0]["all_reduce"].numpy() - exact)
    assert (flat_err <= flat_bound).all() and (hier_err <= hier_bound).all()
    diff = np.abs(hier[0]["all_reduce"].numpy().astype(np.float64) - flat[0]["all_reduce"].numpy())
    assert (diff <= flat_bound + hier_bound).all()
    # Not vacuous: the errors reach a good fraction of the bound somewhere.
    assert (flat_err / flat_bound).max() > 0.3 and (hier_err / hier_bound).max() > 0.3


def _count_wire_bytes(log: list[tuple[str, tuple[int, ...], torch.dtype, int]]) -> None:
    """Wrap the collectives the compressed schemes hand their buffers to (in this forked rank only) and log
    (kind, ranks of the group, dtype, bytes this rank sends to the other ranks) for each call."""
    import mixprec.comm.compat as compat

    real_a2a, real_gather, real_all_reduce = dist.all_to_all_single, compat._ALL_GATHER, dist.all_reduce

    def ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))

    def all_to_all_single(output, input, *args, group=None, **kwargs):
        assert not args and "input_split_sizes" not in kwargs  # equal splits: (W-1)/W of the input leaves
        w = len(ranks(group))
        log.append(("all_to_all", ranks(group), input.dtype, input.numel() * input.element_size() * (w - 1) // w))
        return real_a2a(output, input, group=group, **kwargs)

    def all_gather(output, input, group=None, **kwargs):
        w = len(ranks(group))  # the input goes to each of the W-1 others
        log.append(("all_gather", ranks(group), input.dtype, input.numel() * input.element_size() * (w - 1)))
        return real_gather(output, input, group=group, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        log.append(("all_reduce", (), tensor.dtype, tensor.numel() * tensor.element_size()))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_to_all_single, compat._ALL_GATHER, dist.all_reduce = all_to_all_single, all_gather, all_reduce


def _worker_wire(rank: int, world: int, topology: Topology | None) -> dict:
    comp = MinMaxUInt8(chunk_size=CHUNK)
    compressed_all_reduce(_input(rank), compressor=comp, topology=topology)  # creates the subgroups first
    out: dict = {}
    for op in ("all_reduce", "reduce_scatter"):
        log: list = []
        _count_wire_bytes(log)
        if op == "all_reduce":
            stats = compressed_all_reduce(_input(rank), compressor=comp, topology=topology)
        else:
            stats = compressed_reduce_scatter(torch.empty(N // world), _input(rank), compressor=comp, topology=topology)
        out[op] = (stats, list(log))
    return out


def test_wire_bytes_counted_at_the_backend_are_a_quarter_of_fp32_plus_headers(dist_run) -> None:
    for world, topo in [(2, None), (3, None), (4, Topology(2, 2))]:
        results = dist_run(_worker_wire, world, topo, timeout=120)
        for rank, res in enumerate(results):
            for op, (stats, log) in res.items():
                payload = [e for e in log if e[0] != "all_reduce"]
                flags = [e for e in log if e[0] == "all_reduce"]
                assert all(e[3] <= 8 for e in flags)  # only one-element agreement flags besides the payload
                sent = sum(e[3] for e in payload)
                uint8 = sum(e[3] for e in payload if e[2] == torch.uint8)
                assert stats.bytes_sent == sent, (world, op, rank)
                assert stats.bytes_sent_compressed == uint8
                assert stats.bytes_sent_full_precision == sent - uint8
                phases = 2 if op == "all_reduce" else 1
                # every element's code (one byte) crosses to its owner, and back in the all-gather: the rest of
                # the uint8 bytes are the 8-byte headers
                if topo is None:
                    assert stats.header_bytes == uint8 - phases * (world - 1) * N // world
                    ratio = sent / (phases * (world - 1) * 4 * N / world)  # a ring fp32 collective's bytes
                    assert 0.25 < ratio <= 0.25 * (1 + 8 / CHUNK) + 1e-3, ratio
                else:
                    node = rank // 2
                    intra = [e for e in payload if e[1] == (2 * node, 2 * node + 1)]
                    inter = [e for e in payload if e[1] == (rank % 2, rank % 2 + 2)]
                    assert len(intra) + len(inter) == len(payload)
                    assert stats.bytes_sent_intra_node == sum(e[3] for e in intra)
                    assert stats.bytes_sent_inter_node == sum(e[3] for e in inter)
                    assert all(e[2] == torch.uint8 for e in inter)
                    # across the node boundary: the codes of this rank's part of its node slice (N / 4 elements)
                    # in each phase, plus one header per chunk: a quarter of an fp32 exchange of the same part
                    assert stats.bytes_sent_inter_node == phases * N // 4 * (1 + 8 / CHUNK)


def _worker_ef_convergence(rank: int, world: int, steps: int, use_ef: bool, topology) -> torch.Tensor:
    comp = MinMaxUInt8(chunk_size=EF_CHUNK)
    ef = ErrorFeedback() if use_ef else None
    x = _ef_input(rank)  # the same gradient every step: nearest rounding's bias repeats
    total = torch.zeros(EF_N, dtype=torch.float64)
    history = []
    for t in range(steps):
        y = x.clone()
        compressed_all_reduce(y, compressor=comp, error_feedback=ef, topology=topology)
        total += y.double()
        if t + 1 in EF_CHECKPOINTS:
            history.append(total.clone())
    return torch.stack(history)


EF_N, EF_CHUNK, EF_CHECKPOINTS = 1024, 128, (10, 50, 200)


def _ef_input(rank: int) -> torch.Tensor:
    return torch.randn(EF_N, generator=torch.Generator().manual_seed(rank))


def _ef_bound(xs: list[np.ndarray], worker_inputs: list[np.ndarray], steps: int) -> np.ndarray:
    """|sum_{t<=T} out_t - T mean(x)| per element, with error feedback, W = len(xs) ranks.

    Telescoping: with the worker residuals e_k (of the W or m vectors k that get quantized, the ranks' inputs
    flat, the node sums hierarchical) and the server residual s, out_t = mean + (1/W) sum_k (e_k,t-1 - e_k,t)
    + s_t-1 - s_t + r_t, so the sum over T steps is T mean - (1/W) sum_k e_k,T - s_T + sum_t r_t: the residuals
    left at step T (each within quantize.py's bound, not growing with T) plus the fp32 roundings r_t that
    error feedback never sees.
    - worker residual: quantizer_bound of a chunk of v = x_k + e_k; |e_k| <= step_v / 2 makes
      range(v) <= range(x_k) + step_v, so step_v <= range(x_k) / 254.
    - server residual: a = acc + s with acc - mean = (1/W) sum_k (e_k,t-1 - e_k,t) + r, at most twice the
      worker bound (+ r, covered by 1e-6), and |s| <= step_a / 2, so range(a) <= range(mean) + 4 worker + step_a,
      i.e. range(a) <= (range(mean) + 4 worker) * 255 / 254.
    - r_t per element: adding e_k (u |v_k| / W each), the fp32 sum of the decoded vectors (gamma_{W-1}
      relative to their absolute sum / W), the division, adding s (u each), the residual subtractions and,
      hierarchical, the node sums (u |s_i| / W): all within gamma_{W+3} (A + 2 max step), A = mean of |x_r|.
    """
    world = len(xs)
    n_chunks = EF_N // EF_CHUNK  # the parts here are whole chunks, so the chunks are the global 128-blocks
    mean = np.mean([x.astype(np.float64) for x in xs], axis=0)
    abs_mean = np.mean([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    worker = np.zeros(EF_N)
    server = np.zeros(EF_N)
    max_step = 0.0
    for c in range(n_chunks):
        sl = slice(c * EF_CHUNK, (c + 1) * EF_CHUNK)
        for v in worker_inputs:
            rng_v = np.ptp(v[sl].astype(np.float64)) * 255 / 254
            worker[sl] += quantizer_bound(rng_v, np.abs(v[sl]).max() + rng_v / 255) / world
            max_step = max(max_step, rng_v / 255)
        rng_a = (np.ptp(mean[sl]) + 4 * worker[sl].max() + 1e-6) * 255 / 254
        server[sl] = quantizer_bound(rng_a, np.abs(mean[sl]).max() + rng_a / 255)
        max_step = max(max_step, rng_a / 255)
    adds = world + 3
    gamma = adds * U32 / (1 - adds * U32)
    return worker + server + steps * gamma * (abs_mean + 2 * max_step)


@pytest.mark.slow
@pytest.mark.parametrize("world, topology", [(2, None), (4, Topology(2, 2))])
def test_error_feedback_keeps_the_accumulated_sum_on_the_exact_sum(dist_run, world, topology) -> None:
    steps = EF_CHECKPOINTS[-1]
    xs = [_ef_input(r).numpy() for r in range(world)]
    exact = np.mean([x.astype(np.float64) for x in xs], axis=0)
    worker_inputs = xs if topology is None else [(xs[0] + xs[1]).astype(np.float32), (xs[2] + xs[3]).astype(np.float32)]
    with_ef = dist_run(_worker_ef_convergence, world, steps, True, topology, timeout=120)[0].numpy()
    without = dist_run(_worker_ef_convergence, world, steps, False, topology, timeout=120)[0].numpy()
    for i, t in enumerate(EF_CHECKPOINTS):
        err_ef = np.abs(with_ef[i] - t * exact)
        assert (err_ef <= _ef_bound(xs, worker_inputs, t)).all(), (t, (err_ef / _ef_bound(xs, worker_inputs, t)).max())
    bound = _ef_bound(xs, worker_inputs, steps)
    err_ef = np.abs(with_ef[-1] - steps * exact)
    err_no = np.abs(without - np.array(EF_CHECKPOINTS)[:, None] * exact).max(1)
    assert (err_ef / bound).max() > 0.1  # the bound is not vacuous: the error reaches a tenth of it
    # Without feedback, nearest rounding of the same input errs the same way every step: the drift grows
    # linearly in T (20x from T = 10 to 200, up to fp32 roundings) and leaves the feedback bound far behind.
    assert err_no[2] > 0.9 * 20 * err_no[0] and err_no[2] > 10 * bound.max()


# ---------------------------------------------------------------------------------------------- non-finite
def _worker_nonfinite(rank: int, world: int, mode: str, topology, op: str) -> dict:
    comp = MinMaxUInt8(chunk_size=CHUNK, check_finite=mode)
    ef = ErrorFeedback()
    x = _input(rank)
    if rank == 1:
        x[100] = float("nan")
        x[N - 1] = float("inf")
    try:
        if op == "all_reduce":
            stats = compressed_all_reduce(x, compressor=comp, topology=topology, error_feedback=ef)
            result = x
        else:
            result = torch.empty(N // world)
            stats = compressed_reduce_scatter(result, x, compressor=comp, topology=topology, error_feedback=ef)
    except NonFiniteError as exc:
        return {"raised": str(exc)}
    return {"stats": stats, "result": result, "ef": ef.state_dict()}


@pytest.mark.parametrize(
    "world, topology, op",
    [
        (3, None, "all_reduce"),
        (4, Topology(2, 2), "all_reduce"),
        (2, None, "reduce_scatter"),
        (4, Topology(2, 2), "reduce_scatter"),
    ],
)
def test_nonfinite_is_flagged_on_every_rank_or_raised_on_every_rank(dist_run, world, topology, op) -> None:
    flagged = dist_run(_worker_nonfinite, world, "flag", topology, op, timeout=120)
    for r in range(world):
        assert flagged[r]["stats"].found_nonfinite
        assert all((res == 0).all() for res in flagged[r]["ef"].values())  # residuals cleared
    if op == "all_reduce":
        out = flagged[0]["result"]
        assert torch.equal(out.view(torch.int32), flagged[world - 1]["result"].view(torch.int32))  # same bits
        assert out[100].isnan() and out[N - 1].isnan()  # never a finite value where the input was not
        assert out.isfinite().sum() > N // 2  # other chunks unaffected
    else:
        owner = 100 // (N // world)
        assert flagged[owner]["result"][100 % (N // world)].isnan()
        assert flagged[world - 1]["result"][-1].isnan()
    raised = dist_run(_worker_nonfinite, world, "raise", topology, op, timeout=120)
    assert all("some rank's input holds NaN or Inf" in r["raised"] for r in raised)


def _worker_sum_overflow(rank: int, world: int, topology, op: str) -> dict:
    x = _input(rank)
    x[:CHUNK] = 3e38  # finite everywhere; two ranks' fp32 sum is 6e38 > 3.4e38
    if op.endswith("fp16"):
        x = _input(rank).half()
        x[:CHUNK] = 60000.0  # two ranks' sum, 1.2e5, is finite in fp32 but beyond fp16's 65504
    try:
        if op.startswith("all_reduce"):
            compressed_all_reduce(x, compressor=MinMaxUInt8(chunk_size=CHUNK), topology=topology, average=False)
        else:
            out = torch.empty(N // world, dtype=x.dtype)
            compressed_reduce_scatter(out, x, compressor=MinMaxUInt8(chunk_size=CHUNK), average=False)
    except NonFiniteError as exc:
        return {"raised": str(exc)}
    return {"raised": None}


@pytest.mark.parametrize(
    "world, topology, op",
    [
        (2, None, "all_reduce"),
        (4, Topology(2, 2), "all_reduce"),
        (2, None, "reduce_scatter"),
        (2, None, "all_reduce_fp16"),
        (2, None, "reduce_scatter_fp16"),
    ],
)
def test_fp32_sum_overflow_is_reported_as_overflow_not_as_bad_input(dist_run, world, topology, op) -> None:
    for r in dist_run(_worker_sum_overflow, world, topology, op, timeout=120):
        assert r["raised"] is not None and "every rank's input is finite but the reduction overflowed" in r["raised"]


def _worker_one_rank(rank: int, world: int) -> dict:
    x = _input(rank)
    original = x.clone()
    stats = compressed_all_reduce(x, compressor=MinMaxUInt8(chunk_size=CHUNK))
    shard = torch.empty(N)
    compressed_reduce_scatter(shard, original, compressor=MinMaxUInt8(chunk_size=CHUNK))
    bad = original.clone()
    bad[5] = float("nan")
    flagged = compressed_all_reduce(bad, compressor=MinMaxUInt8(chunk_size=CHUNK, check_finite="flag"))
    try:
        compressed_all_reduce(bad.clone(), compressor=MinMaxUInt8(chunk_size=CHUNK))
        raised = None
    except NonFiniteError as exc:
        raised = str(exc)
    return {
        "x": x,
        "original": original,
        "stats": stats,
        "shard": shard,
        "bad": bad,
        "flagged": flagged,
        "raised": raised,
    }


def _worker_one_rank_subgroups(rank: int, world: int) -> str | None:
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    x = _input(rank)
    if rank == 1:
        x[3] = float("inf")
    try:
        compressed_all_reduce(x, groups[rank], compressor=MinMaxUInt8(chunk_size=CHUNK))
        raised = None
    except NonFiniteError as exc:
        raised = str(exc)
    dist.barrier()
    return raised


def test_one_rank_subgroup_reports_nonfinite_without_waiting_for_other_ranks(dist_run) -> None:
    # Only rank 1 finds Inf: telling input from overflow must stay inside its one-rank group (not hang).
    res = dist_run(_worker_one_rank_subgroups, 2, timeout=60)
    assert res[0] is None and "some rank's input holds NaN or Inf" in res[1]


def test_one_rank_group_sends_and_quantizes_nothing(dist_run) -> None:
    res = dist_run(_worker_one_rank, 1, timeout=60)[0]
    assert torch.equal(res["x"], res["original"])  # the mean of one tensor, not a twice-quantized copy
    assert torch.equal(res["shard"], res["original"])
    assert res["stats"].bytes_sent == 0 and not res["stats"].found_nonfinite
    assert res["flagged"].found_nonfinite and res["bad"][5].isnan()
    assert torch.equal(res["bad"][6:], res["original"][6:])
    assert "some rank's input holds NaN or Inf" in res["raised"]


# ---------------------------------------------------------------------------------------------- misc
def _worker_mesh_async_workspace(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    comp = MinMaxUInt8(chunk_size=CHUNK)
    a = _input(rank)
    compressed_all_reduce(a, compressor=comp, topology=mesh)
    b = _input(rank)
    compressed_all_reduce(b, compressor=comp, topology=Topology(2, 2))
    ws = CompressionWorkspace()
    handle = start_compressed_all_reduce(_input(rank), compressor=comp, workspace=ws)
    first = handle.wait()
    assert handle.wait() is first
    sizes = []
    for _ in range(3):
        c = _input(rank)
        compressed_all_reduce(c, compressor=comp, workspace=ws)
        sizes.append(ws.nbytes())
    return {"mesh": a, "topology": b, "again": c, "sizes": sizes}


def test_device_mesh_topology_async_and_workspace_reuse(dist_run) -> None:
    res = dist_run(_worker_mesh_async_workspace, 4, timeout=120)
    for r in range(4):
        assert torch.equal(res[r]["mesh"], res[r]["topology"])  # a DeviceMesh gives the same groups
        assert len(set(res[r]["sizes"])) == 1  # buffers reused, not regrown
    ref, _ = ref_flat_all_reduce(_inputs(4), CHUNK)
    np.testing.assert_array_equal(res[3]["again"].numpy(), ref[0])


def _worker_concurrent(rank: int, world: int, topology: Topology | None) -> dict:
    comp = MinMaxUInt8(chunk_size=CHUNK)
    a, b, c = _input(rank, seed=20), _input(rank, seed=21), _input(rank, seed=22)
    shard = torch.empty(N // world)
    # Three collectives pending at once, none given a workspace: each must get its own buffers (the second
    # quantizing into the first's send buffer while gloo still sends it would corrupt the first).
    handles = [
        start_compressed_all_reduce(a, compressor=comp, topology=topology),
        start_compressed_reduce_scatter(shard, b, compressor=comp, topology=topology),
        start_compressed_all_reduce(c, compressor=comp, topology=topology, average=False),
    ]
    for handle in handles:  # the same order on every rank (a requirement, see the module docstring)
        handle.wait()
    out: dict = {"a": a, "shard": shard, "c": c}
    ws = CompressionWorkspace()
    first = start_compressed_all_reduce(_input(rank), compressor=comp, workspace=ws)
    try:
        start_compressed_all_reduce(_input(rank), compressor=comp, workspace=ws)
        out["busy"] = "no error"
    except RuntimeError as exc:
        out["busy"] = str(exc)
    first.wait()
    again = _input(rank)
    start_compressed_all_reduce(again, compressor=comp, workspace=ws).wait()  # released by wait()
    out["again"] = again
    return out


@pytest.mark.parametrize("world, topology", [(3, None), (4, Topology(2, 2))])
def test_concurrent_started_collectives_do_not_share_buffers(dist_run, world, topology) -> None:
    res = dist_run(_worker_concurrent, world, topology, timeout=120)
    if topology is None:
        ref_a, _ = ref_flat_all_reduce(_inputs(world, seed=20), CHUNK)
        shards = ref_flat_reduce(_inputs(world, seed=21), CHUNK, divisor=world)
        ref_c, _ = ref_flat_all_reduce(_inputs(world, seed=22), CHUNK, average=False)
        ref_again, _ = ref_flat_all_reduce(_inputs(world), CHUNK)
        ref_a, ref_c, ref_again = ref_a[0], ref_c[0], ref_again[0]
    else:
        ref_a = ref_hierarchical_all_reduce(_inputs(world, seed=20), CHUNK, 2, 2)[0]
        shards = ref_hierarchical_reduce_scatter(_inputs(world, seed=21), CHUNK, 2, 2)
        ref_c = ref_hierarchical_all_reduce(_inputs(world, seed=22), CHUNK, 2, 2, average=False)[0]
        ref_again, _ = ref_flat_all_reduce(_inputs(world), CHUNK)
        ref_again = ref_again[0]
    for r in range(world):
        np.testing.assert_array_equal(res[r]["a"].numpy(), ref_a)
        np.testing.assert_array_equal(res[r]["shard"].numpy(), shards[r])
        np.testing.assert_array_equal(res[r]["c"].numpy(), ref_c)
        assert res[r]["busy"].startswith("workspace is still held by a started compressed collective")
        np.testing.assert_array_equal(res[r]["again"].numpy(), ref_again)


def _worker_bad_args(rank: int, world: int) -> list[str]:
    caught = []
    comp = MinMaxUInt8(chunk_size=CHUNK)
    cases = [
        lambda: compressed_all_reduce(torch.arange(8), compressor=comp),
        lambda: compressed_all_reduce(torch.randn(8), compressor="uint8"),
        lambda: compressed_all_reduce(torch.randn(8), compressor=comp, average=1),
        lambda: compressed_all_reduce(torch.randn(8), compressor=comp, topology=Topology(3, 1)),
        lambda: compressed_all_reduce(torch.randn(8), compressor=comp, topology=(1, 2)),
        lambda: compressed_all_reduce(torch.randn(8), compressor=comp, error_feedback={}),
        lambda: compressed_reduce_scatter(torch.empty(3), torch.randn(8), compressor=comp),
        lambda: compressed_reduce_scatter(torch.empty(4), torch.randn(7), compressor=comp),
        lambda: compressed_all_reduce(torch.randn(8), compressor=comp, workspace=object()),
    ]
    for case in cases:
        try:
            case()
            caught.append("no error")
        except (TypeError, ValueError) as exc:
            caught.append(f"{type(exc).__name__}: {exc}")
    ef = ErrorFeedback()
    compressed_all_reduce(torch.randn(8), compressor=comp, error_feedback=ef)
    try:
        compressed_all_reduce(torch.randn(10), compressor=comp, error_feedback=ef)
        caught.append("no error")
    except ValueError as exc:
        caught.append(f"ValueError: {exc}")
    dist.barrier()
    return caught


def test_bad_arguments(dist_run) -> None:
    caught = dist_run(_worker_bad_args, 2, timeout=60)[0]
    expected = [
        "TypeError: tensor must have dtype torch.float32 or torch.float16 or torch.bfloat16; got torch.int64",
        "TypeError: compressor must be a mixprec.compress.MinMaxUInt8",
        "TypeError: average must be a bool",
        "ValueError: topology has 3 nodes x 1 ranks = 3 ranks but the group has 2",
        "TypeError: topology must be a mixprec.comm.Topology",
        "TypeError: error_feedback must be a mixprec.compress.ErrorFeedback",
        "ValueError: output must be contiguous with tensor.numel() / group size = 4 elements",
        "ValueError: tensor.numel() = 7 is not divisible by the group size 2",
        "TypeError: workspace must be a CompressionWorkspace",
        "ValueError: error_feedback holds a worker residual of 8 elements but this call needs 10",
    ]
    assert len(caught) == len(expected)
    for got, want in zip(caught, expected):
        assert got.startswith(want), (got, want)


def test_topology_validation(monkeypatch) -> None:
    with pytest.raises(ValueError, match="nodes must be an int >= 1"):
        Topology(0, 2)
    with pytest.raises(TypeError, match="ranks_per_node"):
        Topology(2, 1.5)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE is not set"):
        Topology.from_env(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Topology.from_env(8) == Topology(4, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="does not divide the world size 8"):
        Topology.from_env(8)


def _one_rank_narrow_output(rank: int, world_size: int) -> tuple[bool, str]:
    t = torch.full((2048,), 1e6, dtype=torch.float32)
    out = torch.empty(2048, dtype=torch.float16)  # 1e6 is beyond fp16's range: the copy overflows
    stats = compressed_reduce_scatter(out, t, compressor=MinMaxUInt8(check_finite="flag"), average=True)
    try:
        compressed_reduce_scatter(out, t, compressor=MinMaxUInt8(check_finite="raise"), average=True)
        raised = "no error"
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    return stats.found_nonfinite, raised


def test_one_rank_reduce_scatter_flags_overflow_into_a_narrower_output(dist_run) -> None:
    found, raised = dist_run(_one_rank_narrow_output, 1, timeout=60)[0]
    assert found
    assert raised.startswith("NonFiniteError") and "overflow" in raised, raised


def _worker_hostile_args(rank: int, world: int) -> dict:
    comp = MinMaxUInt8(chunk_size=CHUNK)
    cases = [
        lambda: compressed_all_reduce(torch.randn(8), "x", compressor=comp),
        lambda: compressed_reduce_scatter(torch.empty(4), torch.randn(8), 1, compressor=comp),
        lambda: compressed_all_reduce(torch.randn(8), dist.GroupMember.NON_GROUP_MEMBER, compressor=comp),
        lambda: compressed_reduce_scatter(None, torch.randn(8), compressor=comp),
        lambda: compressed_all_reduce(torch.empty(8, device="meta"), compressor=comp),
        lambda: compressed_reduce_scatter(torch.empty(4, device="meta"), torch.randn(8), compressor=comp),
        lambda: CompressedReducer().all_reduce(torch.randn(256), "x", average=True, key=0),
        lambda: compressed_all_reduce(torch.randn(8).to(torch.float8_e4m3fn), compressor=comp),
        lambda: compressed_all_reduce(torch.randn(8, dtype=torch.complex64), compressor=comp),
        lambda: compressed_all_reduce(torch.randn(8), compressor=comp, average="False"),
    ]
    caught = []
    for case in cases:
        try:
            case()
            caught.append("no error")
        except (TypeError, ValueError) as exc:
            caught.append(f"{type(exc).__name__}: {exc}")
    # A tensor that requires grad is reduced like any other, as torch.distributed.all_reduce does.
    leaf = _input(rank).requires_grad_()
    compressed_all_reduce(leaf, compressor=comp)
    shard = torch.empty(N // world, requires_grad=True)
    compressed_reduce_scatter(shard, _input(rank).requires_grad_(), compressor=comp)
    dist.barrier()
    return {"caught": caught, "leaf": leaf.detach(), "shard": shard.detach()}


def test_hostile_arguments_get_one_clear_error(dist_run) -> None:
    res = dist_run(_worker_hostile_args, 2, timeout=60)
    expected = [
        "TypeError: group must be a torch.distributed ProcessGroup or None; got str",
        "TypeError: group must be a torch.distributed ProcessGroup or None; got int",
        "ValueError: group: this rank is not a member of it",
        "TypeError: output must be a torch.Tensor; got NoneType",
        "ValueError: tensor is on the meta device",
        "ValueError: output is on the meta device",
        "TypeError: group must be a torch.distributed ProcessGroup or None; got str",
        "TypeError: tensor must have dtype torch.float32 or torch.float16 or torch.bfloat16; got torch.float8_e4m3fn",
        "TypeError: tensor must have dtype torch.float32 or torch.float16 or torch.bfloat16; got torch.complex64",
        "TypeError: average must be a bool (True or False); got str 'False'",
    ]
    caught = res[0]["caught"]
    assert len(caught) == len(expected)
    for got, want in zip(caught, expected):
        assert got.startswith(want), (got, want)
    ref, _ = ref_flat_all_reduce(_inputs(2), CHUNK)
    shards = ref_flat_reduce(_inputs(2), CHUNK, divisor=2)
    for r in range(2):
        np.testing.assert_array_equal(res[r]["leaf"].numpy(), ref[0])
        np.testing.assert_array_equal(res[r]["shard"].numpy(), shards[r])
