"""The fp32 sum of P received shards (``mixprec.comm.fp32_sum.sum_shards_into``, round to nearest): the
compiled one-pass kernel vs the torch path (``mixprec.native.disabled()``), and the plain fp32 sum a user would
write (``shards.float().sum(0)`` then a cast), in the same run, taking turns call by call.

Every fp32-accumulating reduction ends in this sum: the flat all-to-all (P = world size, after the data is in),
both stages of the hierarchical scheme (P = ranks per node, then nodes; overlapped with the wire) and the DDP
hook. One thread, as each rank of ``bench_netns_fp32.py`` has.

    python benchmarks/bench_fp32_sum.py [--quick]
"""

from __future__ import annotations

import argparse

import torch

from _common import machine_header, markdown_table, time_alternating
from mixprec import native
from mixprec.comm.fp32_sum import sum_shards_into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1M elements only, fewer calls (a smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(machine_header("fp32 sum of P shards: compiled vs torch path"))
    print(f"- path: {native.describe()}\n")
    sizes = (2**20,) if args.quick else (2**20, 2**22)
    repeat = 3 if args.quick else 10
    rows = []
    for numel in sizes:
        for p in (2, 4, 8):
            shards = torch.randn(p, numel).to(torch.bfloat16)
            out = torch.empty(numel, dtype=torch.bfloat16)

            def compiled(shards=shards, out=out) -> None:
                sum_shards_into(out, shards, average=True, rounding="nearest", generator=None)

            def torch_path(shards=shards, out=out) -> None:
                with native.disabled():
                    sum_shards_into(out, shards, average=True, rounding="nearest", generator=None)

            def naive(shards=shards, out=out) -> None:
                out.copy_(shards.float().sum(0).div_(shards.shape[0]))

            t_c, t_t = time_alternating(compiled, torch_path, repeat=repeat)
            _, t_n = time_alternating(compiled, naive, repeat=repeat)
            gbs = (p + 1) * numel * 2 / t_c / 1e9
            rows.append([f"{numel / 2**20:g}M", p, 1e3 * t_c, 1e3 * t_t, 1e3 * t_n, t_t / t_c, t_n / t_c, gbs])
    header = ["elements", "P", "compiled ms", "torch path ms", "naive ms", "torch/compiled", "naive/compiled",
              "compiled GB/s (bf16 in + out)"]  # fmt: skip
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
