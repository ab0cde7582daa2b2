"""All-reduce on a bandwidth-limited network: fp32, bf16, fp32-accumulate (bf16 wire) and uint8 (flat and
hierarchical) on gloo ranks living in network namespaces ("nodes") linked through a rate-limited switch.

Needs root (it creates network namespaces, veth pairs, a bridge and ``tc`` qdiscs) and ``ip``/``tc``:

    sudo python benchmarks/bench_netns.py [--quick] [--rates 0.5,1,2.5,5,10,0] [--sizes 16,32,64]

Network: ``--nodes`` namespaces ``<tag>n<i>`` each hold one veth end ``<tag>e<i>`` (address 10.213.X.i+1/24,
X picked so that no address or route of the host uses 10.213.X.0/24); the other ends ``<tag>s<i>`` sit on a
bridge in a switch namespace ``<tag>sw``. A ``tbf`` qdisc on both ends of every link limits each node's
upload and download to the rate (rate 0 = no qdisc: the raw speed of veth, i.e. CPU-bound). Ranks of one
node talk over that namespace's loopback (not limited), like GPUs inside a machine. ``<tag>`` is ``mpxb``
plus the process id; everything is removed in ``finally`` (and on SIGTERM/SIGINT/SIGHUP), and namespaces left
by a killed earlier run (``mpxb<pid>...`` whose process no longer exists) are removed first; those of a run
still alive are left alone. Every rank and the whole run have timeouts.

Each configuration (``nodes x ranks per node``) runs in one set of rank processes (``ip netns exec``, gloo
over TCP, ``GLOO_SOCKET_IFNAME`` = the node's veth, one torch thread each); rank 0 changes the qdiscs between
rates. Per (rate, size): one warm-up call of each method, then ``--reps`` rounds in which the methods take
turns, one call each between barriers (so load from other processes falls on all of them alike); the time of
a call is the slowest rank's; the table shows the median over rounds. Bytes: this rank's accounting
(``CompressionStats`` for uint8; the ring all-reduce's ``2 (W-1)/W N s`` for gloo's own collectives) and,
independently, the kernel's ``tx_bytes`` of each node's veth (frames: payload + Ethernet/IP/TCP headers +
ACKs), per call and node.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

TAG_PREFIX = "mpxb"
# <prefix><pid of the run that created it><"sw" | "n"<node>>
STALE_NAMESPACE = re.compile(rf"^{TAG_PREFIX}(\d+)(?:sw|n\d+)$")
SUBNET_BASE = "10.213"


# ------------------------------------------------------------------------------------------- network
def run(cmd: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


def netns(ns: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["ip", "netns", "exec", ns, *cmd], check=check)


class Network:
    """``nodes`` namespaces on a switch namespace; rate limits with tbf. Use as a context manager."""

    def __init__(self, nodes: int, tag: str, third_octet: int) -> None:
        self.nodes = nodes
        self.tag = tag
        self.switch = f"{tag}sw"
        self.node_ns = [f"{tag}n{i}" for i in range(nodes)]
        self.node_if = [f"{tag}e{i}" for i in range(nodes)]
        self.switch_if = [f"{tag}s{i}" for i in range(nodes)]
        self.addr = [f"{SUBNET_BASE}.{third_octet}.{i + 1}" for i in range(nodes)]
        self.created: list[str] = []

    def __enter__(self) -> Network:
        try:
            for ns in [self.switch, *self.node_ns]:
                run(["ip", "netns", "add", ns])
                self.created.append(ns)
                netns(ns, "ip", "link", "set", "lo", "up")
            netns(self.switch, "ip", "link", "add", "name", "br0", "type", "bridge")
            netns(self.switch, "ip", "link", "set", "br0", "up")
            for i in range(self.nodes):
                ends = [self.node_if[i], "netns", self.node_ns[i], "type", "veth"]
                ends += ["peer", "name", self.switch_if[i], "netns", self.switch]
                run(["ip", "link", "add", *ends])
                netns(self.switch, "ip", "link", "set", self.switch_if[i], "master", "br0", "up")
                netns(self.node_ns[i], "ip", "addr", "add", f"{self.addr[i]}/24", "dev", self.node_if[i])
                netns(self.node_ns[i], "ip", "link", "set", self.node_if[i], "up")
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def teardown(self) -> None:
        # Deleting a namespace deletes the veth ends in it (and so their peers) and the bridge.
        for ns in reversed(self.created):
            run(["ip", "netns", "del", ns], check=False)
        self.created.clear()

    def links(self) -> list[tuple[str, str]]:
        """(namespace, interface) of both ends of every node's link."""
        return [(self.node_ns[i], self.node_if[i]) for i in range(self.nodes)] + [
            (self.switch, self.switch_if[i]) for i in range(self.nodes)
        ]

    def spec(self) -> dict:
        return {"switch": self.switch, "node_ns": self.node_ns, "node_if": self.node_if, "links": self.links()}


def set_rate(links: list[list[str]], gbit: float) -> None:
    """tbf on every link end (egress), or no qdisc for ``gbit == 0``.

    burst: at least one timer tick's worth of bytes (rate / 250 Hz) and 64 KiB (a GSO segment); latency
    20 ms bounds the queue (beyond it packets drop and TCP backs off, as on a real switch port).
    """
    for ns, dev in links:
        netns(ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        if gbit > 0:
            burst = max(64 * 1024, int(gbit * 1e9 / 8 / 250))
            rate = f"{gbit * 1000:.0f}mbit"
            netns(
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                str(burst),
                "latency",
                "20ms",
            )


def free_third_octet() -> int:
    used = run(["ip", "-4", "addr"]).stdout + run(["ip", "-4", "route"]).stdout
    for octet in range(77, 255):
        if f"{SUBNET_BASE}.{octet}." not in used:
            return octet
    raise RuntimeError(f"every {SUBNET_BASE}.X.0/24 is in use on this host")


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a pid reused by another process counts as alive: keep, to be safe)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> None:
    """Delete the namespaces of earlier runs that died without cleaning up: only names of this script's form
    whose pid is no longer a live process (a concurrent run's namespaces are never touched)."""
    for line in run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = STALE_NAMESPACE.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or process_alive(pid):
            continue
        print(f"removing namespace {name} left by run {pid}, which no longer exists", file=sys.stderr)
        run(["ip", "netns", "del", name], check=False)


# ------------------------------------------------------------------------------------------- rank side
def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from datetime import timedelta

    from mixprec.comm import Topology, all_reduce_fp32_accumulate
    from mixprec.compress import MinMaxUInt8, compressed_all_reduce
    from mixprec.compress.collectives import CompressionWorkspace

    rank, world, per_node = cfg["rank"], cfg["world"], cfg["per_node"]
    local = rank % per_node
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=cfg["timeout"]))
    topology = Topology(world // per_node, per_node)
    comp = MinMaxUInt8(chunk_size=2048)
    workspace = CompressionWorkspace()
    counter = f"/sys/class/net/{cfg['iface']}/statistics/tx_bytes"

    def tx_bytes() -> int:
        with open(counter) as f:
            return int(f.read())

    stats_box: dict = {}

    def fp32(x: torch.Tensor) -> None:
        dist.all_reduce(x)

    def bf16(x: torch.Tensor) -> None:
        dist.all_reduce(x)

    def fp32acc(x: torch.Tensor) -> None:
        all_reduce_fp32_accumulate(x, average=True)

    def uint8(x: torch.Tensor) -> None:
        stats_box["stats"] = compressed_all_reduce(x, compressor=comp, workspace=workspace)

    def uint8_hier(x: torch.Tensor) -> None:
        stats_box["stats"] = compressed_all_reduce(x, compressor=comp, workspace=workspace, topology=topology)

    methods = {"fp32": (fp32, torch.float32), "bf16": (bf16, torch.bfloat16), "fp32acc": (fp32acc, torch.bfloat16)}
    methods["uint8"] = (uint8, torch.float32)
    if per_node > 1:
        methods["uint8_hier"] = (uint8_hier, torch.float32)
    probe_out: dict[str, torch.Tensor] = {}
    if cfg["probe"] and per_node == 1:
        # gloo's all-to-all of the uint8 payload's bytes as one call, and as 8 concurrent async calls: why
        # the compressed collectives pipeline over segments.
        def a2a_1(x: torch.Tensor) -> None:
            dist.all_to_all_single(probe_out["a2a x1"].view(-1), x.view(-1))

        def a2a_8(x: torch.Tensor) -> None:
            out = probe_out["a2a x8"]
            works = [dist.all_to_all_single(out[k], x[k], async_op=True) for k in range(8)]
            for w in works:
                w.wait()

        methods["a2a x1"] = (a2a_1, torch.uint8)
        methods["a2a x8"] = (a2a_8, torch.uint8)

    def make_input(name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        if dtype == torch.uint8:  # probe: 8 contiguous [world, m] pieces, row p of each goes to rank p
            probe_out[name] = torch.empty(8, world, numel // (8 * world), dtype=torch.uint8)
            return torch.zeros(8, world, numel // (8 * world), dtype=torch.uint8)
        return torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(dtype)

    rows = []
    for gbit in cfg["rates"]:
        dist.barrier()
        if rank == 0:
            set_rate(cfg["links"], gbit)
        dist.barrier()
        for numel in cfg["sizes"]:
            inputs = {name: make_input(name, dtype, numel) for name, (_, dtype) in methods.items()}
            for name, (fn, _) in methods.items():
                fn(inputs[name])  # warm-up: connections, buffers
            times = {name: [] for name in methods}
            cpus = {name: [] for name in methods}
            tx = dict.fromkeys(methods, 0)
            stats = {}
            # The methods take turns call by call, so that load from other processes falls on all alike.
            for _ in range(cfg["reps"]):
                for name, (fn, _) in methods.items():
                    dist.barrier()
                    tx0 = tx_bytes()
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn(inputs[name])
                    times[name].append(time.perf_counter() - t0)
                    cpus[name].append(time.process_time() - c0)
                    dist.barrier()  # every rank's sends have left before the counter is read
                    tx[name] += tx_bytes() - tx0
                    stats[name] = stats_box.get("stats")
            for name, (_, dtype) in methods.items():
                slowest = torch.tensor(times[name], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                x = inputs[name]
                if name.startswith("uint8"):
                    st = stats[name]
                    accounted, inter = st.bytes_sent, st.bytes_sent_inter_node
                elif dtype == torch.uint8:  # one all-to-all
                    accounted = inter = (world - 1) * x.numel() // world
                else:  # gloo's ring all-reduce
                    accounted = inter = 2 * (world - 1) * numel * x.element_size() // world
                if per_node > 1 and name != "uint8_hier":
                    inter = None  # these schemes do not know which of their peers are on another node
                info = [tx[name] / cfg["reps"] if local == 0 else 0.0, statistics.mean(cpus[name]), accounted, inter]
                gathered = [None] * world
                dist.all_gather_object(gathered, info)
                if rank == 0:
                    nodes = world // per_node
                    rows.append(
                        {
                            "rate": gbit,
                            "method": name,
                            "numel": numel,
                            "ms": 1e3 * statistics.median(slowest.tolist()),
                            "ms_all": [1e3 * t for t in slowest.tolist()],
                            "cpu_ms": 1e3 * statistics.mean(g[1] for g in gathered),
                            "veth_tx_per_node": sum(g[0] for g in gathered) / nodes,
                            "accounted_per_rank": gathered[0][2],
                            "accounted_inter_node_per_rank": gathered[0][3],
                        }
                    )
                    print(f"[{world // per_node}x{per_node}] {gbit:g} Gbit/s {name:10s} {numel / 2**20:.0f}M: "
                          f"{rows[-1]['ms']:.1f} ms", file=sys.stderr, flush=True)  # fmt: skip
            del inputs
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- driver
def run_ranks(
    net: Network, per_node: int, script: str, cfg_common: dict, port: int, out: str, deadline: float, limit: float
) -> list[dict]:
    """Start ``script --worker CFG`` for every rank in its node's namespace, watch them until they all exit
    (a failed rank or the ``deadline`` stops the others), and return the rows rank 0 wrote to ``out``."""
    world = net.nodes * per_node
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = []
    try:
        for rank in range(world):
            node = rank // per_node
            cfg = {**cfg_common, "rank": rank, "iface": net.node_if[node]}
            env = {
                **os.environ,
                "MASTER_ADDR": net.addr[0],
                "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": net.node_if[node],
                "LOCAL_WORLD_SIZE": str(per_node),
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join([os.path.join(repo, "src"), os.environ.get("PYTHONPATH", "")]),
            }
            cmd = ["ip", "netns", "exec", net.node_ns[node], sys.executable, script, "--worker", json.dumps(cfg)]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        while any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
            if failed:  # the others would wait for the dead rank until their collective timeout
                raise RuntimeError(f"a rank exited with code {failed[0]} (see its stderr above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"benchmark deadline reached ({limit:.0f} s)")
            time.sleep(0.5)
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"rank exit codes {[p.returncode for p in procs]} (see their stderr above)")
    finally:
        # Every rank is killed and reaped even if one of them resists (each step in its own try).
        for p in procs:
            try:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError as exc:
                print(f"could not kill rank process group {p.pid}: {exc}", file=sys.stderr)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                print(f"rank process {p.pid} did not exit 10 s after SIGKILL", file=sys.stderr)
    with open(out) as f:
        return json.load(f)


def launch(net: Network, per_node: int, args: argparse.Namespace, out: str, deadline: float) -> list[dict]:
    cfg_common = {
        "world": net.nodes * per_node,
        "per_node": per_node,
        "rates": args.rates,
        "sizes": [int(s * 2**20) for s in args.sizes],
        "reps": args.reps,
        "links": net.links(),
        "timeout": args.rank_timeout,
        "out": out,
        "probe": not args.no_probe,
    }
    port = 29400 + os.getpid() % 500
    return run_ranks(net, per_node, __file__, cfg_common, port, out, deadline, args.deadline)


def report(config: str, rows: list[dict], methods: list[str]) -> None:
    from _common import markdown_table

    by = {(r["rate"], r["method"], r["numel"]): r for r in rows}
    rates = sorted({r["rate"] for r in rows}, key=lambda g: (g == 0, g))
    sizes = sorted({r["numel"] for r in rows})
    rate_name = {g: ("unlimited (veth, no qdisc)" if g == 0 else f"{g:g} Gbit/s") for g in rates}
    best = "uint8_hier" if "uint8_hier" in methods else "uint8"
    print(f"\n#### {config}: time per all-reduce (ms, median of the slowest rank) and speedups of {best}\n")
    header = ["rate", "elements", *[f"{m} ms" for m in methods], f"{best} vs fp32", f"{best} vs bf16"]
    if best != "uint8":
        header.append("uint8 vs fp32")
    table = []
    for g in rates:
        for n in sizes:
            ms = {m: by[g, m, n]["ms"] for m in methods}
            row = [rate_name[g], f"{n / 2**20:.0f}M", *[ms[m] for m in methods]]
            row += [ms["fp32"] / ms[best], ms["bf16"] / ms[best]]
            if best != "uint8":
                row.append(ms["fp32"] / ms["uint8"])
            table.append(row)
    print(markdown_table(header, table))

    print(f"\n#### {config}: bytes per all-reduce (largest size), accounting vs the veth counters\n")
    n = sizes[-1]
    g = 1.0 if 1.0 in rates else rates[0]
    table = []
    for m in methods:
        r = by[g, m, n]
        table.append(
            [
                m,
                f"{r['accounted_per_rank'] / 2**20:.1f}",
                "-"
                if r["accounted_inter_node_per_rank"] is None
                else f"{r['accounted_inter_node_per_rank'] / 2**20:.1f}",
                f"{r['veth_tx_per_node'] / 2**20:.1f}",
                r["cpu_ms"],
            ]
        )
    print(f"(rate {rate_name[g]}, {n / 2**20:.0f}M elements; MiB)\n")
    print(
        markdown_table(
            [
                "method",
                "accounted sent / rank",
                "inter-node / rank (accounted)",
                "veth tx / node (kernel)",
                "CPU ms / rank",
            ],
            table,
        )
    )
    crossover(config, by, rates, sizes, best)


def probe_report(config: str, rows: list[dict]) -> None:
    from _common import markdown_table

    by = {(r["rate"], r["method"], r["numel"]): r for r in rows}
    table = []
    for (g, m, n), r in sorted(by.items()):
        if m == "a2a x1":
            wire = 8 * r["accounted_per_rank"] / (g * 1e9) * 1e3 if g else float("nan")
            table.append(
                [f"{g:g} Gbit/s" if g else "unlimited", f"{n / 2**20:.0f} MiB", r["ms"], by[g, "a2a x8", n]["ms"], wire]
            )
    print(f"\n#### {config}: gloo all-to-all of the uint8 payload, one call vs 8 concurrent calls\n")
    print(markdown_table(["rate", "uint8 payload (all ranks)", "1 call ms", "8 concurrent ms", "wire time ms"], table))


def crossover(config: str, by: dict, rates: list[float], sizes: list[int], best: str) -> None:
    """Speedup of the compressed all-reduce over bf16 and fp32 per rate, and the rate where it falls to 1x
    (interpolated linearly in log(rate) between the two measured rates around it).
    """
    from _common import markdown_table

    limited = [g for g in rates if g > 0]
    table = []
    for n in sizes:
        for base in ("fp32", "bf16"):
            speedup = {g: by[g, base, n]["ms"] / by[g, best, n]["ms"] for g in rates}
            where = "beyond the fastest measured rate"
            for lo, hi in itertools.pairwise(limited):
                if speedup[lo] > 1 >= speedup[hi]:
                    a, b = math.log(lo), math.log(hi)
                    t = (speedup[lo] - 1) / (speedup[lo] - speedup[hi])
                    where = f"~{math.exp(a + t * (b - a)):.1f} Gbit/s"
                    break
            else:
                if limited and speedup[limited[0]] <= 1:
                    where = "below the slowest measured rate"
            table.append([f"{n / 2**20:.0f}M", f"{best} vs {base}", *[f"{speedup[g]:.2f}x" for g in rates], where])
    names = [("unlimited" if g == 0 else f"{g:g} Gbit/s") for g in rates]
    print(f"\n#### {config}: speedup of {best} by rate, and where compression stops paying\n")
    print(markdown_table(["elements", "comparison", *names, "crossover (1x)"], table))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="2 nodes x 1 and x 2, 1 and 10 Gbit/s, 1M-4M elements")
    ap.add_argument("--rates", default=None, help="Gbit/s, comma-separated; 0 = no rate limit")
    ap.add_argument("--sizes", default=None, help="millions (2**20) of elements, comma-separated")
    ap.add_argument("--per-node", default=None, help="ranks per node, comma-separated configurations (default 1,2)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per point (after one warm-up)")
    ap.add_argument("--deadline", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--rank-timeout", type=float, default=600, help="seconds a collective may wait for a peer")
    ap.add_argument("--no-probe", action="store_true", help="skip the all-to-all probe (1 call vs 8 concurrent)")
    args = ap.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    args.rates = [float(r) for r in (args.rates or ("1,10" if args.quick else "0.5,1,2.5,5,10,0")).split(",")]
    args.sizes = [float(s) for s in (args.sizes or ("1,4" if args.quick else "16,32,64")).split(",")]
    per_node_list = [int(p) for p in (args.per_node or "1,2").split(",")]
    args.reps = args.reps or (2 if args.quick else 3)
    args.deadline = args.deadline or (300 if args.quick else 3600)
    if os.geteuid() != 0:
        sys.exit("bench_netns.py needs root (network namespaces, veth, tc)")
    for tool in ("ip", "tc"):
        if run(["which", tool], check=False).returncode != 0:
            sys.exit(f"bench_netns.py needs the '{tool}' command (iproute2)")

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _common import machine_header

    def on_signal(signum: int, frame: object) -> None:
        # Unwind through the finally blocks (kill the ranks, delete the namespaces); a second signal while
        # cleaning up must not interrupt the cleanup.
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(f"stopped by signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)
    deadline = time.monotonic() + args.deadline
    remove_stale_namespaces()
    tag = f"{TAG_PREFIX}{os.getpid()}"  # the full pid: remove_stale_namespaces tells dead runs by it
    print(machine_header("All-reduce across network namespaces with a tc rate limit (gloo)"))
    print(f"- network: {args.nodes} node namespaces on a bridge, tbf on both ends of each link, MTU 1500")
    print(f"- sizes: {args.sizes} x 2**20 fp32 elements; {args.reps} timed calls per point after a warm-up")
    from mixprec import native  # builds the kernels once here; the ranks load them from the cache

    print(f"- quantizer path (uint8 encode/decode): {native.describe()}")
    results = {}
    with Network(args.nodes, tag, free_third_octet()) as net, tempfile.TemporaryDirectory() as tmp:
        for per_node in per_node_list:
            config = f"{args.nodes} nodes x {per_node} rank{'s' if per_node > 1 else ''}"
            results[config] = launch(net, per_node, args, os.path.join(tmp, f"{per_node}.json"), deadline)
    for config, rows in results.items():
        methods = ["fp32", "bf16", "fp32acc", "uint8"]
        if any(r["method"] == "uint8_hier" for r in rows):
            methods.append("uint8_hier")
        report(config, rows, methods)
        if any(r["method"] == "a2a x1" for r in rows):
            probe_report(config, rows)
    print("\nRaw rows (JSON):", json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
