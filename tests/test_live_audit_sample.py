"""The live audit's sample (mixprec.comm.live_audit.AuditSample): which elements of a large bucket are reduced
exactly, that successive visits cover every element of the shards, and that a sampled audit on gloo ranks is
exact for what it samples (against numpy's fp64 sum of the regenerated buckets at the sampled indices) for an
all-reduce and for each rank's shard of a reduce-scatter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mixprec.comm.live_audit import AUDIT_SAMPLE_ELEMENTS, AuditSample, LiveAudit
from mixprec.testing import run_distributed

U_BF16 = 2.0**-8


def _indices(s: AuditSample) -> list[int]:
    return [c * s.stride + s.offset + j for c in range(s.count) for j in range(s.length)]


def test_small_bucket_is_audited_whole_and_large_one_in_shard_segments() -> None:
    assert AuditSample.choose(1000, 4, 1000, 7) == AuditSample(1000, 0, 1000, 1000, 1)
    assert AuditSample.choose(1000, 4, None, 0).numel == 1000
    s = AuditSample.choose(1000, 4, 40, 0)
    assert (s.stride, s.length, s.count, s.offset, s.numel) == (250, 10, 4, 0, 40)
    assert AuditSample.choose(1000, 4, 40, 3).offset == 30
    assert AuditSample.choose(1000, 4, 40, 25).offset == 0  # 25 windows of 10 per shard: round again
    flat = torch.arange(1000)
    assert s.take(flat).tolist() == _indices(s)
    # Shard r = [250 r, 250 (r + 1)) holds exactly its own segment.
    for r in range(4):
        runs = s.overlap(250 * r, 250)
        assert runs == [(10 * r, 0, 10)]
    assert s.overlap(5, 250) == [(5, 0, 5), (10, 245, 5)]
    assert LiveAudit(1).sample == AUDIT_SAMPLE_ELEMENTS


@pytest.mark.parametrize(("numel", "world", "limit"), [(1000, 4, 40), (1003, 3, 64), (130, 2, 129), (96, 4, 7)])
def test_visits_cover_every_element_of_the_shards(numel: int, world: int, limit: int) -> None:
    seen: set[int] = set()
    for visit in range(numel):
        s = AuditSample.choose(numel, world, limit, visit)
        assert s.numel <= max(limit, world) and s.offset + s.length <= s.stride
        seen.update(_indices(s))
    assert seen == set(range(world * (numel // world)))  # all but the < P elements past the last whole shard


def _bucket(rank: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rank)
    return (torch.randn(n, generator=gen) * 2.0 ** torch.randint(-8, 8, (n,), generator=gen)).to(torch.bfloat16)


def _sampled_case(rank: int, world: int, n: int, limit: int) -> list[dict]:
    torch.set_num_threads(1)
    audit = LiveAudit(1, sample=limit)
    bucket = _bucket(rank, n)
    out = []
    for _ in range(3):  # three visits of bucket 0: three windows
        audit.new_step(1)
        pending = audit.begin(bucket, None, average=True, native=True, index=0)
        assert torch.equal(bucket, _bucket(rank, n))  # the audit only reads the bucket
        exact = pending.exact.clone()
        reduced = torch.zeros(n, dtype=torch.float64)  # a "reducer" that returns the exact mean, in fp64
        reduced[_indices(pending.sample)] = exact
        whole = pending.finish(reduced)
        shard = n // world
        out.append(
            {
                "sample": pending.sample,
                "exact": exact,
                "whole": (whole.numel, whole.mixprec.rel_l2, whole.native.rel_l2),
                "row": whole.as_row(),
            }
        )
        audit.new_step(1)
        pending = audit.begin(bucket, None, average=True, native=False, index=0)
        mine = torch.zeros(n, dtype=torch.float64)
        mine[_indices(pending.sample)] = pending.exact
        part = pending.finish(mine[rank * shard : (rank + 1) * shard], offset=rank * shard)
        out[-1]["shard"] = (part.numel, part.mixprec.rel_l2)
    return out


def test_sampled_audit_is_exact_for_what_it_samples() -> None:
    world, n, limit = 3, 3 * 1000, 300
    rows = np.stack([_bucket(r, n).double().numpy() for r in range(world)])
    reference = rows.sum(axis=0) / world
    results = run_distributed(_sampled_case, world, n, limit, timeout=120)
    for per_rank in results:
        offsets = []
        for got in per_rank:
            s = got["sample"]
            offsets.append(s.offset)
            assert (s.count, s.length, s.stride) == (3, 100, 1000)
            np.testing.assert_array_equal(got["exact"].numpy(), reference[_indices(s)])
            numel, rel, native = got["whole"]
            # gloo's bf16 recipe: a pre-division and two additions per element, each rounding (u = 2^-8):
            # gamma_3 of sum |x_r| / P (Higham), relative to the exact mean.
            idx = _indices(s)
            cond = np.linalg.norm(np.abs(rows[:, idx]).sum(axis=0) / world) / np.linalg.norm(reference[idx])
            assert numel == 300 and rel == 0.0 and 0 < native <= 3 * U_BF16 / (1 - 3 * U_BF16) * cond
            assert got["shard"] == (100, 0.0)
            row = got["row"]
            assert (row["audit_sample_offset"], row["audit_sample_count"], row["audit_bucket_numel"]) == (
                s.offset,
                3,
                n,
            )
        assert offsets == [0, 200, 400]  # visits 0, 2, 4 (each step audits bucket 0 twice here)
