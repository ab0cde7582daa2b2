"""fp32-accumulating reduce-scatter and all-reduce across rate-limited "nodes": hierarchical vs flat vs gloo.

Needs root and ``ip``/``tc``; reuses the network of ``bench_netns.py`` (namespaces on a bridge, ``tbf`` on both
ends of every link, ranks of a node on its loopback):

    sudo python benchmarks/bench_netns_fp32.py [--quick] [--rates 1,2.5,10] [--sizes 16,64] [--json out.json]

Methods, each as reduce-scatter (``rs``) and all-reduce (``ar``) of N elements: ``hier`` (the two-stage
``topology=`` scheme, bf16 wire, node partials rounded to bf16), ``flat`` (one all-to-all over the whole group,
Megatron-LM's ``reduce_scatter_with_fp32_accumulation``), ``bf16`` and ``fp32`` (gloo's own collectives). Per
(rate, size) one warm-up call of each, then ``--reps`` rounds in which the methods take turns between barriers;
a call's time is the slowest rank's, the table shows the median. Inter-node bytes: the accounting of each
scheme per node beside the kernel's ``tx_bytes`` of the node's veth (frames: payload + headers + ACKs). The
JSON (``--json``) holds every row plus the machine, whether the compiled fp32 sum ran (``MIXPREC_NATIVE=0``
runs the torch path) and hier's segment lengths: ``mixprec study comm-cost --calibration FILE`` fits its
model on it and prints model vs measured. Goals at 1 Gbit/s (2 nodes x 2 ranks): hier's veth bytes <= bf16's,
time <= 0.9x bf16 and <= 0.6x flat.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_netns import TAG_PREFIX, Network, free_third_octet, remove_stale_namespaces, run, run_ranks, set_rate

METHODS = ("hier", "flat", "bf16", "fp32")


def accounted_inter_node(method: str, op: str, numel: int, nodes: int, per_node: int) -> float:
    """Bytes one node sends to other nodes per call, by each scheme's own arithmetic."""
    world = nodes * per_node
    size = 4 if method == "fp32" else 2
    phases = 2 if op == "ar" else 1
    if method == "hier":  # (m-1)/m N per phase (the all-reduce's inter-node all-gather mirrors stage 2)
        return phases * (nodes - 1) / nodes * numel * size
    if method == "flat":  # all-to-all: every rank sends S to each of (m-1) n remote ranks; the gather is a ring
        a2a = per_node * (nodes - 1) * per_node * numel / world * size
        return a2a + (phases - 1) * (world - 1) / world * numel * size
    return phases * (world - 1) / world * numel * size  # a node-major ring: one edge leaves each node


# ------------------------------------------------------------------------------------------- rank side
def worker(cfg: dict) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from mixprec import native
    from mixprec.comm import Topology, all_reduce_fp32_accumulate, reduce_scatter_fp32_accumulate
    from mixprec.comm.compat import reduce_scatter_flat
    from mixprec.comm.hierarchical_fp32 import area_elements, segment_bounds, segment_length

    rank, world, per_node = cfg["rank"], cfg["world"], cfg["per_node"]
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout"]))
    topology = Topology(world // per_node, per_node)
    counter = f"/sys/class/net/{cfg['iface']}/statistics/tx_bytes"

    def tx_bytes() -> int:
        with open(counter) as f:
            return int(f.read())

    scratch: dict[tuple[str, str, int], torch.Tensor] = {}

    def area(method: str, op: str, numel: int) -> torch.Tensor:
        """Kept between calls, as the reducer's pool is: flat, the receive buffer; hier, the default area
        (4 segments)."""
        key = (method, op, numel)
        if key not in scratch:
            size = numel if method == "flat" else area_elements(numel // world, world, world // per_node, op == "ar")
            scratch[key] = torch.empty(size, dtype=torch.bfloat16)
        return scratch[key]

    def call(method: str, op: str, x: torch.Tensor, out: torch.Tensor) -> None:
        if method in ("hier", "flat"):
            topo = topology if method == "hier" else None
            buf = area(method, op, x.numel())
            if op == "rs":
                reduce_scatter_fp32_accumulate(out, x, average=True, topology=topo, scratch=buf)
            else:
                all_reduce_fp32_accumulate(x, average=True, topology=topo, scratch=buf)
        elif op == "rs":
            reduce_scatter_flat(out, x, None)
        else:
            dist.all_reduce(x)

    rows = []
    for gbit in cfg["rates"]:
        dist.barrier()
        if rank == 0:
            set_rate(cfg["links"], gbit)
        dist.barrier()
        for numel in cfg["sizes"]:
            for op in ("rs", "ar"):
                inputs, outs = {}, {}
                for m in METHODS:
                    dtype = torch.float32 if m == "fp32" else torch.bfloat16
                    inputs[m] = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)
                    outs[m] = torch.empty(numel // world, dtype=dtype)
                    call(m, op, inputs[m], outs[m])  # warm-up: connections, subgroups, buffers
                times = {m: [] for m in METHODS}
                tx = dict.fromkeys(METHODS, 0)
                for _ in range(cfg["reps"]):
                    for m in METHODS:
                        dist.barrier()
                        tx0 = tx_bytes()
                        t0 = time.perf_counter()
                        call(m, op, inputs[m], outs[m])
                        times[m].append(time.perf_counter() - t0)
                        dist.barrier()  # every rank's sends have left before the counter is read
                        tx[m] += tx_bytes() - tx0
                for m in METHODS:
                    slowest = torch.tensor(times[m], dtype=torch.float64)
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    # Barriers send a few bytes too; the counter is per node, read by its local rank 0.
                    gathered = [None] * world
                    dist.all_gather_object(gathered, tx[m] / cfg["reps"] if rank % per_node == 0 else 0.0)
                    if rank == 0:
                        nodes = world // per_node
                        extra = {"native_sum": native.library() is not None}  # the compiled fp32 sum ran
                        if m == "hier":  # the pipeline's segment lengths, for the cost model's fill and drain
                            shard = numel // world
                            seg = segment_length(shard, world, area(m, op, numel).numel(), nodes, op == "ar")
                            extra["hier_segments"] = [b - a for a, b in segment_bounds(shard, seg)]
                        rows.append(
                            {
                                "rate": gbit,
                                "op": op,
                                "method": m,
                                "numel": numel,
                                "nodes": nodes,
                                "per_node": per_node,
                                "ms": 1e3 * statistics.median(slowest.tolist()),
                                "ms_all": [1e3 * t for t in slowest.tolist()],
                                "veth_tx_per_node": sum(gathered) / nodes,
                                "accounted_inter_node_per_node": accounted_inter_node(m, op, numel, nodes, per_node),
                                **extra,
                            }
                        )
                        print(f"{gbit:g} Gbit/s {op} {m:5s} {numel / 2**20:.2f}M: {rows[-1]['ms']:.1f} ms",
                              file=sys.stderr, flush=True)  # fmt: skip
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- driver
def launch(net: Network, per_node: int, args: argparse.Namespace, out: str, deadline: float) -> list[dict]:
    cfg_common = {
        "world": net.nodes * per_node,
        "per_node": per_node,
        "rates": args.rates,
        "sizes": args.sizes,
        "reps": args.reps,
        "links": net.links(),
        "timeout": args.rank_timeout,
        "out": out,
    }
    port = 29900 + os.getpid() % 90
    return run_ranks(net, per_node, __file__, cfg_common, port, out, deadline, args.deadline)


def report(rows: list[dict]) -> None:
    from _common import markdown_table

    by = {(r["rate"], r["op"], r["method"], r["numel"]): r for r in rows}
    table = []
    for rate, op, method, numel in sorted(by):
        if method != "hier":
            continue
        ms = {m: by[rate, op, m, numel]["ms"] for m in METHODS}
        veth = {m: by[rate, op, m, numel]["veth_tx_per_node"] for m in METHODS}
        goals = [veth["hier"] <= veth["bf16"], ms["hier"] <= 0.9 * ms["bf16"], ms["hier"] <= 0.6 * ms["flat"]]
        table.append(
            [f"{rate:g}", op, f"{numel / 2**20:.2f}M", *[ms[m] for m in METHODS], ms["hier"] / ms["bf16"],
             ms["hier"] / ms["flat"], " ".join("yes" if g else "NO" for g in goals)]
        )  # fmt: skip
    print("\n#### time per call (ms, median of the slowest rank)\n")
    header = ["Gbit/s", "op", "elements", *[f"{m} ms" for m in METHODS], "hier/bf16", "hier/flat", "goals"]
    print(markdown_table(header, table))
    print("\ngoals: hier veth bytes <= bf16's, time <= 0.9x bf16, time <= 0.6x flat (meant for 1 Gbit/s)")
    table = []
    for (rate, op, method, numel), r in sorted(by.items()):
        table.append(
            [f"{rate:g}", op, f"{numel / 2**20:.2f}M", method, r["accounted_inter_node_per_node"] / 2**20,
             r["veth_tx_per_node"] / 2**20]
        )  # fmt: skip
    print("\n#### inter-node bytes per node and call (MiB): accounting vs the veth counter\n")
    print(markdown_table(["Gbit/s", "op", "elements", "method", "accounted", "veth tx"], table))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="1 Gbit/s only, 1M elements, 2 timed calls (a smoke run)")
    ap.add_argument("--rates", default=None, help="Gbit/s, comma-separated (default 1,2.5,10)")
    ap.add_argument("--sizes", default=None, help="millions (2**20) of elements, comma-separated (default 16,64)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per point (after one warm-up)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--rank-timeout", type=float, default=600, help="seconds a collective may wait for a peer")
    ap.add_argument("--json", default=None, help="write the rows here (the comm-cost study's calibration input)")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    args.rates = [float(r) for r in (args.rates or ("1" if args.quick else "1,2.5,10")).split(",")]
    multiple = 128 * args.nodes * args.per_node
    sizes = [float(s) for s in (args.sizes or ("1" if args.quick else "16,64")).split(",")]
    args.sizes = [max(multiple, int(s * 2**20) // multiple * multiple) for s in sizes]
    args.reps = args.reps or (2 if args.quick else 5)
    args.deadline = args.deadline or (300 if args.quick else 3600)
    if os.geteuid() != 0:
        sys.exit("bench_netns_fp32.py needs root (network namespaces, veth, tc)")
    for tool in ("ip", "tc"):
        if run(["which", tool], check=False).returncode != 0:
            sys.exit(f"bench_netns_fp32.py needs the '{tool}' command (iproute2)")
    from _common import machine_header

    def on_signal(signum: int, frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(f"stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    deadline = time.monotonic() + args.deadline
    remove_stale_namespaces()
    tag = f"{TAG_PREFIX}{os.getpid()}"
    header = machine_header("fp32-accumulating reduce-scatter / all-reduce across rate-limited nodes (gloo)")
    from mixprec import native

    header += f"- fp32 sums: {native.describe()}\n"
    print(header)
    print(f"- {args.nodes} nodes x {args.per_node} ranks, bf16 wire (fp32: gloo fp32), {args.reps} timed calls")
    with Network(args.nodes, tag, free_third_octet()) as net, tempfile.TemporaryDirectory() as tmp:
        rows = launch(net, args.per_node, args, os.path.join(tmp, "rows.json"), deadline)
    report(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "nodes": args.nodes, "per_node": args.per_node, "rows": rows}, f, indent=1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
