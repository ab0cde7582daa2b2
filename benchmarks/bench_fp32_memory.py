"""Peak extra memory of fp32-accumulating bucket reductions over a backward pass with many buckets.

    python benchmarks/bench_fp32_memory.py [--quick] [--buckets 64] [--bucket-m 4]

4 gloo ranks (2 nodes x 2, forked) start every bucket's all-reduce in order, as the wrapper does from its
backward hooks, then wait for all of them. Peak extra bytes through torch's allocator
(``mixprec.comm.memory.measure_peak_allocated``, rank 0, first pass: kept buffers count) for: the hierarchical reducer
(one pooled area, ``budget`` = one bucket), the flat reducer with its default two receive buffers, and one
receive buffer per bucket in flight (Megatron-LM's layout, PR #4940: ``max_in_flight`` = the bucket count).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _case(rank: int, world: int, buckets: int, numel: int) -> dict[str, int]:
    import torch

    from mixprec.comm import Topology, wait_all
    from mixprec.comm.memory import measure_peak_allocated
    from mixprec.parallel import FP32AccumulateReducer

    torch.set_num_threads(1)
    data = [
        torch.randn(numel, generator=torch.Generator().manual_seed(rank + k)).to(torch.bfloat16) for k in range(buckets)
    ]
    reducers = {
        "hierarchical (pooled area)": FP32AccumulateReducer(topology=Topology(2, world // 2)),
        "flat, max_in_flight=2": FP32AccumulateReducer(),
        "flat, one buffer per bucket": FP32AccumulateReducer(max_in_flight=buckets),
    }
    out = {}
    for name, reducer in reducers.items():

        def backward_like(reducer=reducer) -> None:
            wait_all([reducer.all_reduce(b, None, average=True, key=k) for k, b in enumerate(data)])

        # A first pass: the buffers a reducer keeps between steps are allocated here, so they count.
        out[name] = measure_peak_allocated(backward_like)[1]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="52 buckets of 64K elements")
    ap.add_argument("--buckets", type=int, default=64)
    ap.add_argument("--bucket-m", type=float, default=4.0, help="millions (2**20) of bf16 elements per bucket")
    args = ap.parse_args()
    buckets, numel = (52, 1 << 16) if args.quick else (args.buckets, int(args.bucket_m * 2**20))
    numel = max(512, numel // 512 * 512)
    from _common import machine_header, markdown_table
    from mixprec.comm.memory import measure_peak_allocated
    from mixprec.testing import run_distributed

    measure_peak_allocated(sum, [])  # import the profiler before forking
    print(machine_header("Peak extra memory of fp32-accumulating reductions, 2 nodes x 2 ranks (gloo)"))
    result = run_distributed(_case, 4, buckets, numel, timeout=600)[0]
    bucket_bytes = numel * 2
    rows = [[name, peak / 2**20, peak / bucket_bytes] for name, peak in result.items()]
    print(f"{buckets} buckets of {numel} bf16 elements ({bucket_bytes / 2**20:.2f} MiB each)\n")
    print(markdown_table(["reducer", "peak extra MiB", "buckets' worth"], rows))


if __name__ == "__main__":
    main()
