"""``wire="auto"``: choose full precision (fp32 sums), uint8 or fp8 per bucket from a cost model.

Per bucket of N elements of s bytes on W ranks, with the link rate B (bytes/s) and this machine's cost q of
quantizing (seconds per element of the compressed pipeline: encode N + N/W, decode 2N), the estimated time is

    full precision:  2 (W-1)/W N s / B
    uint8 / fp8:     2 (W-1)/W N (1 + h / chunk) / B + q N        (h = 8 or 4 header bytes per chunk)

and the cheapest wins (ties: full precision; fp8 only when 10% cheaper than uint8, which is the more
accurate wire on most gradients: docs/compress.md). B is probed once, with a timed all-reduce, or
given (``link_gbps``); q is measured once per process and device type and cached. Both come from rank 0
and are broadcast, so every rank makes the same choice and issues the same collectives. With the costs of
benchmarks/RESULTS.md compression stops paying near 2 Gbit/s against a bf16 wire. Each bucket's choice
is logged once (logger ``mixprec.compress.auto``) with its reason. Derivation: ``docs/compress.md``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mixprec.compress.fp8 import ScaledFP8
from mixprec.compress.quantize import MinMaxUInt8

__all__ = ["CHOICES", "AutoChoice", "LinkCosts", "choose", "measure_quantize_cost", "probe_link"]

logger = logging.getLogger("mixprec.compress.auto")

CHOICES: tuple[str, ...] = ("full", "uint8", "e4m3")
# fp8 must beat uint8 by this factor: uint8 is the more accurate wire on normal-like gradients, and the
# measured costs carry noise that should not flip the choice from run to run.
_FP8_MARGIN = 0.9
_PROBE_BYTES = 8 << 20  # large enough that tbf's burst and per-call latency are small beside it
_MEASURE_ELEMENTS = 1 << 20
_quantize_cost: dict[str, tuple[float, float, float, float]] = {}  # device type -> (enc, dec) uint8, fp8 (s/elem)


@dataclass(frozen=True)
class LinkCosts:
    """What the model needs, identical on every rank: link bytes/s and per-element encode/decode seconds."""

    link_bytes_per_s: float
    uint8_encode: float
    uint8_decode: float
    fp8_encode: float
    fp8_decode: float


@dataclass(frozen=True)
class AutoChoice:
    """One bucket's choice (``"full"``, ``"uint8"`` or ``"e4m3"``) and the estimated seconds of each."""

    wire: str
    estimates: dict[str, float]
    numel: int

    def reason(self, link_bytes_per_s: float) -> str:
        est = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in self.estimates.items())
        return f"link {link_bytes_per_s * 8 / 1e9:.3g} Gbit/s; estimated {est}"


def measure_quantize_cost(device: torch.device) -> tuple[float, float, float, float]:
    """Seconds per element of encode and decode for uint8 and fp8 e4m3 on ``device`` (cached per type)."""
    key = device.type
    if key not in _quantize_cost:
        x = torch.randn(_MEASURE_ELEMENTS, generator=torch.Generator().manual_seed(0)).to(device)
        out = torch.empty(_MEASURE_ELEMENTS, device=device)
        costs: list[float] = []
        for comp in (MinMaxUInt8(), ScaledFP8("e4m3")):
            buf = comp.encode(x)
            comp.decode(buf, x.numel(), out=out)  # warm-up: scratch buffers allocated
            enc = dec = float("inf")
            for _ in range(3):  # the best of three: the least disturbed by other processes
                t0 = _now(device)
                comp.encode(x, out=buf)
                t1 = _now(device)
                comp.decode(buf, x.numel(), out=out)
                t2 = _now(device)
                enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
            costs += [enc / x.numel(), dec / x.numel()]
        _quantize_cost[key] = (costs[0], costs[1], costs[2], costs[3])
    return _quantize_cost[key]


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def probe_link(group: dist.ProcessGroup | None, device: torch.device) -> float:
    """Bytes per second of the ring all-reduce of fp32 on ``group`` (this rank's timing, best of two)."""
    world = dist.get_world_size(group)
    x = torch.zeros(_PROBE_BYTES // 4, device=device)
    dist.all_reduce(x, group=group)  # warm-up: connections, buffers
    best = float("inf")
    for _ in range(2):
        dist.barrier(group=group)
        t0 = _now(device)
        dist.all_reduce(x, group=group)
        best = min(best, _now(device) - t0)
    return 2 * (world - 1) / world * _PROBE_BYTES / best


def agree_costs(group: dist.ProcessGroup | None, device: torch.device, link_gbps: float | None) -> LinkCosts:
    """Rank 0's link rate (probed unless ``link_gbps`` is given) and quantizing costs, broadcast to all ranks.

    Every rank must call it at the same point (it issues collectives when the group has several ranks)."""
    rate = link_gbps * 1e9 / 8 if link_gbps is not None else None
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world > 1 and rate is None:
        rate = probe_link(group, device)
    costs = measure_quantize_cost(device)
    values = torch.tensor([rate if rate is not None else float("inf"), *costs], dtype=torch.float64)
    if world > 1:
        backend_device = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
        values = values.to(backend_device)
        dist.broadcast(values, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    v = values.cpu().tolist()
    return LinkCosts(v[0], v[1], v[2], v[3], v[4])


def choose(costs: LinkCosts, numel: int, element_size: int, world: int, chunk_size: int) -> AutoChoice:
    """The cheapest wire for a bucket of ``numel`` elements of ``element_size`` bytes on ``world`` ranks."""
    ring = 2 * (world - 1) / world if world > 1 else 0.0
    rate = costs.link_bytes_per_s
    chunks = -(-numel // chunk_size)
    if world == 1:  # nothing is sent or quantized on one rank
        return AutoChoice("full", {"full": 0.0}, numel)
    q8 = (1 + 1 / world) * costs.uint8_encode + 2 * costs.uint8_decode
    qf = (1 + 1 / world) * costs.fp8_encode + 2 * costs.fp8_decode
    est = {
        "full": ring * numel * element_size / rate,
        "uint8": ring * (numel + 8 * chunks) / rate + q8 * numel,
        "e4m3": ring * (numel + 4 * chunks) / rate + qf * numel,
    }
    compressed = "e4m3" if est["e4m3"] < _FP8_MARGIN * est["uint8"] else "uint8"
    wire = "full" if est["full"] <= est[compressed] else compressed
    return AutoChoice(wire, est, numel)
