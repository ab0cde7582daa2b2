"""wire="auto": the cost model, the same choice on every rank, bit-exact results whichever wire it picks, and a
rate-limited link (network namespaces + tc) as a check of the probe's plumbing.

The choice depends on measured speeds (the link rate, this CPU's quantizing cost), which differ with the machine
and its load; so every test of *which* wire is chosen gives the decision function its measurements (the cost
model directly, or the reducers with the quantizing costs given and the link rate given), and the netns test
asserts only what holds on any machine: the probe returns a positive finite rate no faster than the shaped link
allows, and the reducer's choice is the cost model applied to what it measured."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import mixprec.hooks
from compress_reference import ref_flat_all_reduce
from mixprec.comm import make_reducer
from mixprec.compress import auto

CHUNK = 256
BUCKET = 3 * 1024


# Per-element quantizing costs (s) of the order measured on a 2-core development CPU: uint8 encode 1.7 ns,
# decode 1.1 ns; fp8 6 ns each. CHEAP_FP8: a machine whose fp8 codec is the cheaper one.
QUANTIZE = (1.7e-9, 1.1e-9, 6e-9, 6e-9)
CHEAP_FP8 = (6e-9, 6e-9, 1e-9, 1e-9)


def _costs(gbps: float, quantize: tuple[float, float, float, float] = QUANTIZE) -> auto.LinkCosts:
    return auto.LinkCosts(gbps * 1e9 / 8, *quantize)


def test_cost_model_crossover() -> None:
    n = 1 << 22
    # bf16 wire: full precision sends 2 bytes, uint8 1 byte + 4.8 ns of quantizing per element
    assert auto.choose(_costs(0.5), n, 2, 2, 2048).wire == "uint8"
    assert auto.choose(_costs(10), n, 2, 2, 2048).wire == "full"
    # the crossover against bf16 lies between 1 and 2.5 Gbit/s here, as measured in benchmarks/RESULTS.md
    assert auto.choose(_costs(1.0), n, 2, 2, 2048).wire == "uint8"
    assert auto.choose(_costs(2.5), n, 2, 2, 2048).wire == "full"
    # fp8 wins when its quantizing is clearly the cheaper one, not on noise
    cheap_fp8 = auto.LinkCosts(0.5e9 / 8, 6e-9, 6e-9, 1e-9, 1e-9)
    assert auto.choose(cheap_fp8, n, 4, 2, 2048).wire == "e4m3"
    same = auto.LinkCosts(0.5e9 / 8, 1.7e-9, 1.1e-9, 1.6e-9, 1.1e-9)
    assert auto.choose(same, n, 4, 2, 2048).wire == "uint8"
    assert auto.choose(_costs(0.5), n, 4, 1, 2048).wire == "full"  # one rank: nothing to send
    choice = auto.choose(_costs(0.5), n, 2, 2, 2048)
    assert "0.5 Gbit/s" in choice.reason(_costs(0.5).link_bytes_per_s)


def test_link_rate_option_is_validated() -> None:
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="link_gbps"):
            make_reducer("auto", link_gbps=bad)
    with pytest.raises(TypeError, match="link_gbps"):
        make_reducer("auto", link_gbps="1")
    with pytest.raises(ValueError, match="wire"):
        make_reducer("auto", wire="uint8")


def _bucket(rank: int, key: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * key + rank)
    return torch.randn(BUCKET, generator=g) * (1 + rank)


def _worker_auto(rank: int, world: int, gbps: float | None) -> dict:
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    auto.logger.addHandler(Keep())
    auto.logger.setLevel(logging.INFO)
    reducer = make_reducer("auto", chunk_size=CHUNK, link_gbps=gbps)
    buckets = [_bucket(rank, k) for k in range(2)]
    for _ in range(2):  # the second round reuses the choices: logged once per bucket
        for k, b in enumerate(buckets):
            reducer.all_reduce(b, None, average=True, key=k).wait()
    shard = torch.empty(BUCKET // world)
    reducer.reduce_scatter(shard, _bucket(rank, 5), None, average=True, key=5).wait()
    return {"buckets": buckets, "choices": {k: c.wire for k, c in reducer.choices.items()}, "log": records}


@pytest.mark.parametrize(
    ("gbps", "quantize", "expected"),
    [(0.01, QUANTIZE, "uint8"), (0.5, CHEAP_FP8, "e4m3"), (1000.0, QUANTIZE, "full")],
    ids=["slow-uint8", "slow-fp8", "fast-full"],
)
def test_auto_reducer_same_choice_on_every_rank_and_bit_exact(
    dist_run, monkeypatch, gbps: float, quantize: tuple[float, float, float, float], expected: str
) -> None:
    # The quantizing costs are given, not measured (the forked ranks inherit the patch): the wire is then the cost
    # model's choice on any machine, under any load.
    monkeypatch.setattr(auto, "measure_quantize_cost", lambda device: quantize)
    assert auto.choose(_costs(gbps, quantize), BUCKET, 4, 2, CHUNK).wire == expected
    res = dist_run(_worker_auto, 2, gbps, timeout=120)
    wire = res[0]["choices"][0]
    assert wire == expected
    assert res[0]["choices"] == res[1]["choices"] == {0: wire, 1: wire, 5: wire}
    assert len(res[0]["log"]) == 3 and all(wire in line and "Gbit/s" in line for line in res[0]["log"])
    # Run twice with the same buckets: the first round's results are the inputs of the second.
    for k in range(2):
        inputs = [_bucket(r, k).numpy() for r in range(2)]
        if wire != "full":
            once = ref_flat_all_reduce(inputs, CHUNK, wire=wire)[0][0]
            expected = ref_flat_all_reduce([once, once], CHUNK, wire=wire)[0][0]
        else:  # fp32 sums in rank order, divided by 2: exact for the mean of two equal vectors
            once = ((inputs[0] + inputs[1]) / np.float32(2)).astype(np.float32)
            expected = once
        for r in range(2):
            np.testing.assert_array_equal(res[r]["buckets"][k].numpy(), expected)


def _worker_hook(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = mixprec.hooks.CompressedHookState(chunk_size=CHUNK, wire="auto", link_gbps=0.01)
    ddp.register_comm_hook(state, mixprec.hooks.compressed_hook)
    g = torch.Generator().manual_seed(rank)
    ddp(torch.randn(8, 16, generator=g)).square().mean().backward()
    return {"choices": {k: c.wire for k, c in state.choices.items()}, "bytes": state.bytes_sent_total}


def test_auto_hook_compresses_on_a_slow_link(dist_run, monkeypatch) -> None:
    monkeypatch.setattr(auto, "measure_quantize_cost", lambda device: QUANTIZE)  # given, as above
    res = dist_run(_worker_hook, 2, timeout=120)
    assert res[0]["choices"] == res[1]["choices"] and "full" not in res[0]["choices"].values()
    assert res[0]["bytes"] > 0


# ---------------------------------------------------------------------------------------------- netns
_WORKER = textwrap.dedent(
    """
    import dataclasses, json, os, sys, datetime
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    from mixprec.comm import make_reducer
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    reducer = make_reducer("auto", chunk_size=2048)
    bucket = torch.randn(1 << 20).bfloat16()
    reducer.all_reduce(bucket, None, average=True, key=0).wait()
    if rank == 0:
        costs = list(dataclasses.astuple(reducer.link_costs))
        print(json.dumps({"wire": reducer.choices[0].wire, "costs": costs}))
    dist.destroy_process_group()
    """
)


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


def _free_subnet() -> str:
    used = _sh("ip", "-4", "addr").stdout + _sh("ip", "-4", "route").stdout
    for third in range(200, 250):
        if f"10.214.{third}." not in used:
            return f"10.214.{third}"
    pytest.skip("no free 10.214.x.0/24 subnet")


def _set_rate(ns: str, dev: str, gbit: float) -> None:
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
    burst = _burst(gbit)
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit",
        "burst", str(burst), "latency", "50ms")  # fmt: skip


def _rate_bound(gbit: float) -> float:
    """The most bytes/s the probe can measure through a tbf shaper at ``gbit``, on any machine: each direction
    carries 2 (W-1)/W of the probe's bytes (W = 2), of which at most one burst (the bucket starts full) passes
    faster than the rate; 10% for the shaper's accounting. A slower machine only measures less."""
    sent = auto._PROBE_BYTES
    return 1.1 * gbit * 1e9 / 8 * sent / (sent - _burst(gbit))


def _burst(gbit: float) -> int:
    return max(64 * 1024, int(gbit * 1e9 / 8 / 250))  # one 250 Hz timer tick's worth, as bench_netns.py


def test_auto_probes_a_rate_limited_link_and_decides_by_the_cost_model() -> None:
    """The plumbing, on a real link: which wire wins depends on this machine's speed and load (under load a
    10 Gbit/s link measured 2.6 Gbit/s and uint8 rightly won), so it is not asserted here; the decision itself is
    tested with given measurements above."""
    if not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("needs the ip and tc commands (iproute2)")
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, veth, tc)")
    tag = f"mpxt{os.getpid()}"
    ns, dev = [tag + "a", tag + "b"], [tag + "ea", tag + "eb"]
    subnet = _free_subnet()
    addr = [f"{subnet}.1", f"{subnet}.2"]
    created: list[str] = []
    try:
        for name in ns:
            if _sh("ip", "netns", "add", name, check=False).returncode:
                pytest.skip("cannot create network namespaces here")
            created.append(name)
            _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        _sh("ip", "link", "add", dev[0], "netns", ns[0], "type", "veth", "peer", "name", dev[1], "netns", ns[1])
        for i in range(2):
            _sh("ip", "netns", "exec", ns[i], "ip", "addr", "add", f"{addr[i]}/24", "dev", dev[i])
            _sh("ip", "netns", "exec", ns[i], "ip", "link", "set", dev[i], "up")
        for port, gbit in ((29611, 0.5), (29621, 10.0)):
            picked = _measure(ns, dev, addr, gbit, port)
            print(f"auto on a {gbit} Gbit/s link:", picked)
            costs = auto.LinkCosts(*picked["costs"])
            # a rate was measured on the shaped link (not on loopback: it cannot beat the shaper) ...
            assert math.isfinite(costs.link_bytes_per_s) and 0 < costs.link_bytes_per_s <= _rate_bound(gbit)
            assert all(math.isfinite(c) and c > 0 for c in picked["costs"][1:])
            # ... and the reducer chose what the cost model gives for what it measured
            assert picked["wire"] == auto.choose(costs, 1 << 20, 2, 2, 2048).wire
    finally:
        for name in created:
            _sh("ip", "netns", "del", name, check=False)  # removes the veth pair with it


def _measure(ns: list[str], dev: list[str], addr: list[str], gbit: float, port: int) -> dict:
    """Run the auto reducer once on the two namespaces with both ends limited to ``gbit``; rank 0's choice."""
    for i in range(2):
        _set_rate(ns[i], dev[i], gbit)
    env = dict(os.environ, MASTER_ADDR=addr[0], MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath("src"), env.get("PYTHONPATH", "")])
    procs = []
    for i in range(2):
        env_i = dict(env, GLOO_SOCKET_IFNAME=dev[i])
        cmd = ["ip", "netns", "exec", ns[i], sys.executable, "-c", _WORKER, str(i)]
        procs.append(subprocess.Popen(cmd, env=env_i, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return json.loads(outs[0][0].strip().splitlines()[-1])
