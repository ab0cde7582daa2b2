"""Reduce-scatter of bf16/fp16 gradients on gloo: mixprec's fp32-accumulating one vs the alternatives.

Same run, same inputs, per (ranks, elements, dtype):

* native: gloo's own ``reduce_scatter`` in the wire dtype (rounds the running sum; what torch users get);
* mixprec: ``reduce_scatter_fp32_accumulate`` (all_to_all in the wire dtype, fp32 sum, one rounding),
  with a preallocated ``scratch`` receive buffer as the DDP wrapper uses it;
* cast-fp32: cast the input to fp32, gloo's fp32 reduce-scatter, cast the shard back (exact sums
  the usual way: twice the bytes on the wire and an fp32 copy of the input).

Time: median over repetitions of the slowest rank's time per call, each call between barriers; the
methods take turns (one call each per round) so that load from other work falls on all of them alike.
Memory, per rank, two ways: "alloc" is the peak of torch's own allocator above the inputs (torch.profiler
allocation events, mixprec.comm.measure_peak_allocated: what the function allocates through torch);
"RSS" is the process's peak resident memory above its level before the call (/proc/self/clear_refs resets
the peak), which also sees gloo's internal buffers but is coarser (page granularity, allocator caching).
The mixprec "alloc" figure is with a preallocated receive buffer passed as ``scratch``; the next column
adds that buffer back (scratch size + alloc) and measures a call that allocates its own (no ``scratch``),
since the receive buffer is extra memory the caller pays for either way.

    python benchmarks/bench_reduce_scatter.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from _common import machine_header, markdown_table
from mixprec.comm import reduce_scatter_fp32_accumulate
from mixprec.comm.compat import reduce_scatter_flat
from mixprec.comm.memory import measure_peak_allocated
from mixprec.testing import run_distributed

MIB = 1 << 20


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return -1


def _peak_rss_extra(fn) -> float:
    """Peak RSS above the current RSS while ``fn`` runs, MiB (Linux: clear_refs 5 resets VmHWM)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return float("nan")
    before = _rss_kib("VmRSS:")
    fn()
    return (_rss_kib("VmHWM:") - before) / 1024


def _methods(x: torch.Tensor, world_size: int) -> dict[str, Callable[[], None]]:
    shard = x.numel() // world_size
    y = torch.empty(shard, dtype=x.dtype)
    scratch = torch.empty(x.numel(), dtype=x.dtype)

    def native() -> None:
        reduce_scatter_flat(y, x, None)

    def mixprec() -> None:
        reduce_scatter_fp32_accumulate(y, x, scratch=scratch)

    def cast_fp32() -> None:
        y32 = torch.empty(shard, dtype=torch.float32)
        reduce_scatter_flat(y32, x.float(), None)
        y.copy_(y32)

    return {"native": native, "mixprec": mixprec, "cast": cast_fp32}


def _measure_all(methods: dict[str, Callable[[], None]], repeat: int, row: dict) -> None:
    for fn in methods.values():
        for _ in range(2):  # warm-up (and first touch of the buffers)
            fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    # Round-robin, one call of each method per round: load from other work on a shared machine falls
    # on all methods alike.
    for _ in range(repeat):
        for name, fn in methods.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    for name, fn in methods.items():
        # A collective takes as long as its slowest rank: max over ranks per repetition, then the median.
        per_rep = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(per_rep, op=dist.ReduceOp.MAX)
        row[f"{name}_s"] = statistics.median(per_rep.tolist())
        dist.barrier()
        _, alloc = measure_peak_allocated(fn)
        row[f"{name}_alloc_mib"] = alloc / MIB
        dist.barrier()
        row[f"{name}_rss_mib"] = _peak_rss_extra(fn)


def _bench_rank(rank: int, world_size: int, sizes: list[int], dtypes: list[str], repeat: int) -> list[dict]:
    out = []
    for numel in sizes:
        for dtype_name in dtypes:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(getattr(torch, dtype_name))
            row: dict = {"ranks": world_size, "elements": numel, "dtype": dtype_name}
            _measure_all(_methods(x, world_size), repeat, row)
            # mixprec's extra memory counts its receive buffer: preallocated above (the "scratch" a caller
            # keeps, e.g. the DDP wrapper's pool), or allocated inside the call when none is passed.
            y = torch.empty(numel // world_size, dtype=x.dtype)
            dist.barrier()
            _, alloc = measure_peak_allocated(lambda: reduce_scatter_fp32_accumulate(y, x))  # noqa: B023
            row["mixprec_noscratch_alloc_mib"] = alloc / MIB
            row["scratch_mib"] = numel * x.element_size() / MIB
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="2 ranks, 4M elements, bf16, 3 repetitions (seconds)")
    args = ap.parse_args()
    if args.quick:
        plans, sizes, dtypes, repeat = [2], [1 << 22], ["bfloat16"], 3
    else:
        plans, sizes, dtypes, repeat = [2, 4], [1 << 22, 1 << 24, 1 << 26], ["bfloat16", "float16"], 7
    rows = []
    for world_size in plans:
        results = run_distributed(_bench_rank, world_size, sizes, dtypes, repeat, timeout=3600)
        for r0 in results[0]:
            rank_rows = [res for res in results if res]  # memory: the largest rank
            match = [
                next(rr for rr in rank if rr["elements"] == r0["elements"] and rr["dtype"] == r0["dtype"])
                for rank in rank_rows
            ]
            mem = {k: max(m[k] for m in match) for k in r0 if k.endswith("_mib")}
            rows.append(
                [
                    world_size,
                    f"{r0['elements'] // (1 << 20)}M",
                    r0["dtype"].replace("float", "fp").replace("bfp", "bf"),
                    r0["native_s"] * 1e3,
                    r0["mixprec_s"] * 1e3,
                    r0["cast_s"] * 1e3,
                    r0["mixprec_s"] / r0["native_s"],
                    r0["cast_s"] / r0["mixprec_s"],
                    f"{mem['native_alloc_mib']:.1f} / {mem['mixprec_alloc_mib']:.1f} / {mem['cast_alloc_mib']:.1f}",
                    f"{mem['mixprec_alloc_mib'] + mem['scratch_mib']:.1f} / {mem['mixprec_noscratch_alloc_mib']:.1f}",
                    f"{mem['native_rss_mib']:.0f} / {mem['mixprec_rss_mib']:.0f} / {mem['cast_rss_mib']:.0f}",
                ]
            )
    print(machine_header("Reduce-scatter, gloo: fp32 accumulation vs native low precision vs cast to fp32"))
    print(
        markdown_table(
            [
                "ranks",
                "elements",
                "wire",
                "native ms",
                "mixprec ms",
                "cast-fp32 ms",
                "mixprec / native",
                "cast-fp32 / mixprec",
                "extra MiB, torch alloc (native / mixprec / cast)",
                "mixprec extra MiB incl. receive buffer (scratch passed + its size / none passed)",
                "extra MiB, peak RSS (native / mixprec / cast)",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
