"""Training-step time: torch's DistributedDataParallel vs mixprec's wrapper on the same model (gloo, CPU).

Same run, same fp32 MLP, same data, same optimizer (AdamW); a step is zero_grad + forward + backward
(with its gradient reduction) + optimizer step. Variants:

* torch DDP (fp32 wire, gloo's fp32 sum): the baseline every ratio divides by;
* torch DDP + a bf16 wire hook (bf16 wire, gloo's bf16 sum): the algorithm of torch's
  ``bf16_compress_hook`` (cast, pre-divide, all-reduce, cast back), written out here because torch refuses
  that hook on CPU ("requires CUDA 11+ and NCCL 2.10+");
* mixprec native (fp32 wire, gloo's sum): the wrapper's own overhead against torch DDP;
* mixprec fp32_accumulate, fp32 wire;
* mixprec fp32_accumulate, ``grad_dtype=bf16`` (bf16 wire, fp32 sum): against the bf16 wire hook;
* mixprec fp32_accumulate, bf16 wire, ``sharded_optimizer=True`` (ZeRO-1).

Bucket sizes match: torch's 25 MB cap in fp32 elements for the wrapper. Time: median over steps of the
slowest rank's step; the variants take turns, one step each, so that load from other work on a
shared machine spreads over all of them.

``--audit-every N`` adds the bf16-wire fp32_accumulate variant with the live numerics audit
(``audit_every=N``), runs at least 2N timed steps, and prints the audit's cost: the mean step time with
and without it (a mean, not a median: one step in N pays for the audit; under load its noise exceeds the
audit's cost) and the audit's own time per step, ``audit seconds / N`` over the step: the steadier number.
``--audit-sample M``: elements audited per audit (default mixprec's 65536; 0 = the whole bucket, the audit's
cost before it was sampled). ``--audit-only``: time only torch DDP and the two bf16-wire fp32_accumulate
variants, with and without the audit (the short run for the audit's cost).

    python benchmarks/bench_ddp.py [--quick] [--audit-every N [--audit-sample M] [--audit-only]]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from _common import machine_header, markdown_table
from mixprec.comm.live_audit import AUDIT_SAMPLE_ELEMENTS
from mixprec.parallel import DistributedDataParallel
from mixprec.testing import run_distributed

BUCKET_MB = 25
VARIANTS = (
    "torch DDP",
    "torch DDP + bf16 wire hook",
    "mixprec native",
    "mixprec fp32_accumulate",
    "mixprec fp32_accumulate, bf16 wire",
    "mixprec fp32_accumulate, bf16 wire, ZeRO-1",
)


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 16))


def _bf16_wire_hook(state, bucket):  # no annotations: torch DDP compares them with its own types
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16).div_(dist.get_world_size(state))
    dist.all_reduce(wire, group=state)
    buffer.copy_(wire)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _audited(audit_every: int) -> str:
    return f"mixprec fp32_accumulate, bf16 wire, audit every {audit_every}"


def _variants(audit_every: int | None, audit_only: bool) -> tuple[str, ...]:
    if not audit_every:
        return VARIANTS
    plain = ("torch DDP", "mixprec fp32_accumulate, bf16 wire") if audit_only else VARIANTS
    return (*plain, _audited(audit_every))


def _build(variant: str, width: int, depth: int, audit_every: int | None = None, audit_sample: int = 0):
    model = _model(width, depth)
    bucket_elems = BUCKET_MB * (1 << 20) // 4
    if variant.startswith("torch"):
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        if "bf16" in variant:
            ddp.register_comm_hook(None, _bf16_wire_hook)
        return ddp, torch.optim.AdamW(model.parameters(), lr=1e-4)
    reduce = "native" if variant == "mixprec native" else "fp32_accumulate"
    grad_dtype = torch.bfloat16 if "bf16 wire" in variant else None
    ddp = DistributedDataParallel(
        model,
        bucket_size=bucket_elems,
        reduce=reduce,
        grad_dtype=grad_dtype,
        sharded_optimizer="ZeRO" in variant,
        audit_every=audit_every if "audit" in variant else None,
    )
    ddp.audit.sample = audit_sample or None
    return ddp, ddp.make_optimizer(torch.optim.AdamW, lr=1e-4)


def _bench_rank(
    rank: int,
    world_size: int,
    width: int,
    depth: int,
    batch: int,
    steps: int,
    audit_every: int | None = None,
    audit_sample: int = AUDIT_SAMPLE_ELEMENTS,
    audit_only: bool = False,
) -> dict[str, float]:
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=gen), torch.randn(batch, 16, generator=gen)
    variants = _variants(audit_every, audit_only)
    setups = {variant: _build(variant, width, depth, audit_every, audit_sample) for variant in variants}
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    # Round-robin over the variants, one step each: load from other work on a shared machine then
    # falls on all of them alike instead of on whichever variant ran during a busy minute.
    for step in range(steps + 2):  # two warm-up rounds
        for variant, (ddp, opt) in setups.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            if step >= 2:
                times[variant].append(time.perf_counter() - t0)
    out = {}
    for variant in variants:
        per_step = torch.tensor(times[variant], dtype=torch.float64)
        dist.all_reduce(per_step, op=dist.ReduceOp.MAX)
        out[variant] = statistics.median(per_step.tolist())
        out[f"mean {variant}"] = statistics.fmean(per_step.tolist())
    if audit_every:
        results = setups[_audited(audit_every)][0].audit_results
        out["audits"] = len(results)
        out["audit seconds"] = max(r.seconds for r in results) if results else 0.0
        out["audit numel"] = max(r.numel for r in results) if results else 0
        out["audit bits"] = results[-1].mixprec.effective_bits if results else float("nan")
        out["audit native bits"] = results[-1].native.effective_bits if results else float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="2 ranks, a small model, 3 steps (seconds)")
    ap.add_argument(
        "--audit-every", type=int, default=None, metavar="N", help="also time the live numerics audit every N steps"
    )
    ap.add_argument(
        "--audit-sample",
        type=int,
        default=AUDIT_SAMPLE_ELEMENTS,
        metavar="M",
        help=f"elements per audit (default {AUDIT_SAMPLE_ELEMENTS}; 0 = the whole bucket)",
    )
    ap.add_argument("--audit-only", action="store_true", help="time torch DDP and the bf16-wire variants only")
    args = ap.parse_args()
    if args.audit_every is not None and args.audit_every < 1:
        ap.error("--audit-every must be an int >= 1")
    if args.audit_sample < 0:
        ap.error("--audit-sample must be an int >= 0")
    if args.audit_only and not args.audit_every:
        ap.error("--audit-only needs --audit-every")
    import torch._dynamo  # noqa: F401  (torch DDP imports it: once here instead of in every forked rank)

    if args.quick:
        plans, width, depth, batch, steps = [2], 256, 2, 32, 3
    else:
        plans, width, depth, batch, steps = [2, 4], 1024, 6, 64, 10
    if args.audit_every:
        steps = max(steps, 2 * args.audit_every)
    params = sum(p.numel() for p in _model(width, depth).parameters())
    rows = []
    audit_lines = []
    for world_size in plans:
        result = run_distributed(
            _bench_rank,
            world_size,
            width,
            depth,
            batch,
            steps,
            args.audit_every,
            args.audit_sample,
            args.audit_only,
            timeout=3600,
        )[0]
        base = result["torch DDP"]
        for variant in _variants(args.audit_every, args.audit_only):
            rows.append([world_size, variant, result[variant] * 1e3, result[variant] / base])
        if args.audit_every:
            plain = result["mean mixprec fp32_accumulate, bf16 wire"]
            audited = result[f"mean {_audited(args.audit_every)}"]
            audit_lines.append(
                f"{world_size} ranks: mean step {plain * 1e3:.2f} ms without the audit, {audited * 1e3:.2f} ms with it "
                f"({(audited / plain - 1) * 100:+.2f}%); {result['audits']} audits of up to {result['audit numel']} "
                f"elements (sample {args.audit_sample or 'whole bucket'}), "
                f"the slowest {result['audit seconds'] * 1e3:.2f} ms on rank 0 "
                f"({result['audit seconds'] / args.audit_every / plain * 100:.2f}% of a step over {args.audit_every}); "
                f"effective bits {result['audit bits']:.1f} (gloo's bf16 sum: {result['audit native bits']:.1f})"
            )
    print(machine_header(f"Training step, torch DDP vs mixprec wrapper (MLP, {params / 1e6:.1f}M fp32 params)"))
    print(f"batch {batch} per rank, AdamW, {steps} timed steps after 2 warm-up steps, {BUCKET_MB} MB buckets\n")
    print(markdown_table(["ranks", "variant", "step ms", "ratio to torch DDP"], rows))
    for line in audit_lines:
        print(line)


if __name__ == "__main__":
    main()
