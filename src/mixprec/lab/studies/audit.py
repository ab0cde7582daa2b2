"""Audit the collectives of the platform you run on against an fp64 reference: ``mixprec audit collectives``.

For each operation (torch's ``all_reduce`` and ``reduce_scatter``, and mixprec.comm's fp32-accumulating ones beside
them), dtype (bf16, fp16, fp32) and message size, every rank draws N(0, 1) inputs and the reference is the fp64 sum
of the inputs gathered with an all-to-all. Reported per row: relative L2 error, max absolute error, max error
relative to the largest sum, effective bits (``-log2`` of the relative L2 error), the fraction of elements equal to
the correctly rounded sum, run-to-run determinism (the same inputs twice give the same bits), message-size
invariance (probe values spread through every message size reduce to the same bits) and agreement across ranks
(all-reduce) or with the same family's all-reduce (reduce-scatter). One verdict line per operation sums it up.

Runs as one rank of a ``torchrun`` job (NCCL when CUDA is available) or forks ``nproc`` gloo ranks on the CPU
(:func:`mixprec.testing.run_distributed`, which starts and stops them as ``mixprec train`` does, and raises
:class:`~mixprec.comm.launcher.RanksFailed` naming the rank that failed). Methods and public sources: docs/audit.md.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm import all_reduce_fp32_accumulate, reduce_scatter_fp32_accumulate
from mixprec.core.progress import progress_bar
from mixprec.emulate import round_to
from mixprec.lab.studies.base import DEFAULT_SEED, pyplot, save_figure
from mixprec.testing import run_distributed

__all__ = [
    "AUDIT_DTYPES",
    "AUDIT_OPS",
    "DEFAULT_FACTOR",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MIN_BYTES",
    "DEFAULT_NPROC",
    "DEFAULT_TIMEOUT",
    "FULL_MAX_BYTES",
    "AuditConfig",
    "AuditRow",
    "audit_citation",
    "audit_rank",
    "check_launch",
    "format_table",
    "parse_size",
    "plot_rows",
    "run_audit",
    "verdicts",
    "write_json",
]

AUDIT_OPS: tuple[str, ...] = (
    "all_reduce",
    "reduce_scatter",
    "all_reduce_fp32_accumulate",
    "reduce_scatter_fp32_accumulate",
)
AUDIT_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
KIB, MIB = 1 << 10, 1 << 20
# The range is 4 KiB to 256 MiB; the default stops at 16 MiB so that a run fits 2 minutes on 2 CPU cores.
FULL_MAX_BYTES = 256 * MIB
DEFAULT_MAX_BYTES = 16 * MIB
# Forked ranks when neither torchrun nor --nproc says: with 2 ranks every element is one addition, rounded once
# whatever the accumulator, so a sum in the wire dtype shows only from 3 ranks on.
DEFAULT_NPROC = 4
MAX_FORKED_RANKS = 64
DEFAULT_MIN_BYTES = 4 * KIB
DEFAULT_FACTOR = 4
# Seconds before a hung collective fails (the process group's timeout, and the forked run's).
DEFAULT_TIMEOUT = 600.0
_PAIR = {"reduce_scatter": "all_reduce", "reduce_scatter_fp32_accumulate": "all_reduce_fp32_accumulate"}
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def parse_size(text: str | int, *, arg: str = "size") -> int:
    """Bytes from ``4096``, ``"4KiB"``, ``"1MiB"``, ``"256MiB"`` (also KB/MB/K/M as powers of two)."""
    if isinstance(text, bool):
        raise TypeError(f"{arg} must be a size such as 4KiB or 256MiB; got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        s = str(text).strip().lower().removesuffix("b").removesuffix("i")
        units = {"k": KIB, "m": MIB, "g": 1 << 30}
        scale = units.get(s[-1:], 1)
        digits = s[:-1] if s[-1:] in units else s
        if not digits.isdigit():
            raise ValueError(f"{arg} must be a size such as 4KiB, 1MiB or 4096; got {text!r}")
        value = int(digits) * scale
    if value < 1:
        raise ValueError(f"{arg} must be at least 1 byte; got {text!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """What to audit.

    Args:
        ops: operations, from ``AUDIT_OPS``.
        dtypes: names from ``AUDIT_DTYPES`` ("bf16", "fp16", "fp32").
        min_bytes, max_bytes: smallest and largest message per rank, in bytes (the input of the reduce-scatter);
            sizes go up by ``factor`` from ``min_bytes``. The issue's full range is 4 KiB to 256 MiB.
        factor: ratio between consecutive sizes, >= 2.
        seed: seed of the inputs (rank r draws from ``seed``, r, the dtype and the size).
    """

    ops: tuple[str, ...] = AUDIT_OPS
    dtypes: tuple[str, ...] = tuple(AUDIT_DTYPES)
    min_bytes: int = DEFAULT_MIN_BYTES
    max_bytes: int = DEFAULT_MAX_BYTES
    factor: int = DEFAULT_FACTOR
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        for name, values, allowed in (("ops", self.ops, AUDIT_OPS), ("dtypes", self.dtypes, tuple(AUDIT_DTYPES))):
            if not isinstance(values, tuple) or not values:
                raise ValueError(f"{name} must be a non-empty tuple of names from {', '.join(allowed)}")
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"unknown {name[:-1]} {', '.join(map(repr, bad))}; choose from {', '.join(allowed)}")
        for name in ("min_bytes", "max_bytes", "factor", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int; got {type(v).__name__} {v!r}")
        if self.min_bytes < 64:
            raise ValueError(f"min_bytes must be at least 64; got {self.min_bytes}")
        if self.max_bytes < self.min_bytes:
            raise ValueError(f"max_bytes ({self.max_bytes}) must be at least min_bytes ({self.min_bytes})")
        if self.factor < 2:
            raise ValueError(f"factor must be >= 2; got {self.factor}")

    def sizes(self) -> list[int]:
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            size *= self.factor
        return out

    def check_world_size(self, world_size: int) -> None:
        """ValueError unless every message holds at least one element per rank and there is something to sum."""
        if isinstance(world_size, bool) or not isinstance(world_size, int):
            raise TypeError(f"world size must be an int; got {type(world_size).__name__}")
        if world_size < 2:
            raise ValueError(f"the audit needs a world size of at least 2 (nothing to reduce); got {world_size}")
        widest = max(AUDIT_DTYPES[d].itemsize for d in self.dtypes)
        if self.min_bytes // widest < world_size:
            raise ValueError(
                f"world size {world_size} exceeds the {self.min_bytes // widest} elements of the smallest message "
                f"({self.min_bytes} bytes): raise min_bytes or use fewer ranks"
            )


@dataclass
class AuditRow:
    """One (operation, dtype, message size). Errors against the fp64 sum ``s`` of the inputs; ``max_rel`` is
    ``max|r - s| / max|s|`` (an elementwise ratio is unbounded where the sum cancels); ``bits`` is
    ``-log2(rel_l2)``, capped at 64 when the result is exact. ``ranks_agree`` is None for reduce-scatter,
    ``matches_all_reduce`` None for all-reduce."""

    op: str
    dtype: str
    bytes: int
    elements: int
    world_size: int
    backend: str
    rel_l2: float
    max_abs: float
    max_rel: float
    bits: float
    correctly_rounded: float
    deterministic: bool
    size_invariant: bool
    ranks_agree: bool | None
    matches_all_reduce: bool | None


# ---------------------------------------------------------------------------------------------- one rank
def _run_op(op: str, x: torch.Tensor, world_size: int) -> torch.Tensor:
    """The op on a copy of ``x``; returns the full result (all-reduce) or this rank's shard (reduce-scatter)."""
    if op == "all_reduce":
        y = x.clone()
        dist.all_reduce(y)
        return y
    if op == "all_reduce_fp32_accumulate":
        y = x.clone()
        all_reduce_fp32_accumulate(y)
        return y
    out = torch.empty(x.numel() // world_size, dtype=x.dtype, device=x.device)
    if op == "reduce_scatter":
        _REDUCE_SCATTER(out, x)
    else:
        reduce_scatter_fp32_accumulate(out, x)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


def _probe_positions(count: int, n: int, *, salt: int) -> torch.Tensor:
    """``count`` distinct positions in ``range(n)``, scattered differently for each ``salt`` (the same on every rank):
    a probe value then lies in a different chunk of the backend's ring or tree at each message size. Positions
    ``j * a + salt (mod n)`` with ``gcd(a, n) = 1`` are distinct for ``j < n``."""
    a = 1_000_003
    while math.gcd(a, n) != 1:
        a += 2
    return (torch.arange(count, dtype=torch.int64) * a + salt) % n


@dataclass
class _Case:
    """One message size of one dtype on this rank: its input ``x`` (``n`` elements, the probe values at
    ``positions``), the fp64 sum of this rank's shard ``[lo, hi)`` over every rank's input and that sum rounded to
    the dtype, and which probe positions lie in the shard."""

    size: int
    n: int
    x: torch.Tensor
    positions: torch.Tensor
    exact: torch.Tensor
    rounded: torch.Tensor
    lo: int
    hi: int
    owned: torch.Tensor


def _case(
    rank: int, world_size: int, config: AuditConfig, seed: int, size: int, probe: torch.Tensor, device: torch.device
) -> _Case:
    """Draw this rank's input of ``size`` bytes (the probe values spread through it) and its fp64 reference, from
    every rank's inputs gathered with an all-to-all (exact up to 2**-53 relative)."""
    dtype = probe.dtype
    n = (size // dtype.itemsize) // world_size * world_size
    shard = n // world_size
    gen = torch.Generator().manual_seed(seed + 7919 * size)
    x = torch.randn(n, generator=gen).to(dtype)
    positions = _probe_positions(probe.numel(), n, salt=(config.seed + 1) * 7919 + size)
    x[positions] = probe
    x = x.to(device)
    recv = torch.empty_like(x)
    dist.all_to_all_single(recv, x)
    exact = recv.view(world_size, shard).double().sum(0)
    lo, hi = rank * shard, (rank + 1) * shard
    owned = (positions >= lo) & (positions < hi)
    return _Case(size, n, x, positions, exact, round_to(exact, dtype).to(device), lo, hi, owned)


def _agreed_stats(
    op: str, case: _Case, first: torch.Tensor, second: torch.Tensor, mine: torch.Tensor, paired: torch.Tensor | None
) -> tuple[list[float], list[float], bool]:
    """Error sums, maxima and the disagreement flag of ``op``, agreed over the ranks: (squared error, squared
    reference, correctly rounded count, nondeterministic), (max error, max reference), and whether the ranks'
    all-reduce results differ (or the reduce-scatter differs from its all-reduce ``paired``)."""
    device = mine.device
    err = mine.double() - case.exact
    stats = torch.tensor(
        [
            float(err.square().sum()),
            float(case.exact.square().sum()),
            float((mine.float() == case.rounded).sum()),
            0.0 if _same_bits(first, second) else 1.0,
        ],
        dtype=torch.float64,
        device=device,
    )
    maxima = torch.tensor([float(err.abs().max()), float(case.exact.abs().max())], dtype=torch.float64, device=device)
    if paired is None:  # an all-reduce: every rank's result against rank 0's
        reference = first.clone()
        dist.broadcast(reference, 0)
        flags = torch.tensor([0.0 if _same_bits(reference, first) else 1.0], device=device)
    else:
        flags = torch.tensor([0.0 if _same_bits(paired, mine) else 1.0], device=device)
    dist.all_reduce(stats)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return stats.tolist(), maxima.tolist(), bool(flags.item())


def _probe_results(op: str, case: _Case, first: torch.Tensor, world_size: int) -> torch.Tensor:
    """The probe values' results of ``op`` (each rank contributes the positions it owns), on the CPU."""
    device = first.device
    n_min = case.positions.numel()
    if op.startswith("all_reduce"):
        return first[case.positions.to(device)].double().cpu()
    local = torch.zeros(n_min, dtype=torch.float64, device=device)
    idx = case.positions[case.owned]
    local[case.owned.to(device)] = first[(idx - case.lo).to(device)].double()
    everyone = torch.empty(world_size * n_min, dtype=torch.float64, device=device)
    _ALL_GATHER(everyone, local)
    owner = (case.positions // (case.n // world_size)).to(device)
    return everyone.view(world_size, n_min).gather(0, owner.view(1, -1))[0].cpu()


def _row(
    op: str, dtype_name: str, case: _Case, world_size: int, backend: str, agreed: tuple[list[float], list[float], bool]
) -> AuditRow:
    (err_sq, ref_sq, cr, nondet), (max_abs, max_ref), disagree = agreed
    rel = math.sqrt(err_sq / ref_sq) if ref_sq > 0 else 0.0
    all_reduce = op.startswith("all_reduce")
    return AuditRow(
        op=op,
        dtype=dtype_name,
        bytes=case.size,
        elements=case.n,
        world_size=world_size,
        backend=backend,
        rel_l2=rel,
        max_abs=max_abs,
        max_rel=max_abs / max_ref if max_ref > 0 else 0.0,
        bits=64.0 if rel == 0 else min(64.0, -math.log2(rel)),
        correctly_rounded=cr / case.n,
        deterministic=not nondet,
        size_invariant=True,
        ranks_agree=not disagree if all_reduce else None,
        matches_all_reduce=None if all_reduce else not disagree,
    )


def _audit_dtype(
    rank: int, world_size: int, config: AuditConfig, d_index: int, device: torch.device, backend: str, bar: Any
) -> list[AuditRow]:
    """Every (operation, message size) of the ``d_index``-th dtype; size invariance over the whole sweep."""
    dtype_name = config.dtypes[d_index]
    dtype = AUDIT_DTYPES[dtype_name]
    n_min = (config.min_bytes // dtype.itemsize) // world_size * world_size
    seed = config.seed * 1_000_003 + rank * 101 + d_index
    probe = torch.randn(n_min, generator=torch.Generator().manual_seed(seed)).to(dtype)  # in every message size
    probe_bits: dict[str, torch.Tensor] = {}
    invariant: dict[str, bool] = dict.fromkeys(config.ops, True)
    rows: list[AuditRow] = []
    for size in config.sizes():
        case = _case(rank, world_size, config, seed, size, probe, device)
        results: dict[str, torch.Tensor] = {}
        for op in config.ops:
            first = _run_op(op, case.x, world_size)
            second = _run_op(op, case.x, world_size)
            mine = first[case.lo : case.hi] if op.startswith("all_reduce") else first
            results[op] = mine
            paired = None
            if not op.startswith("all_reduce"):
                paired = results.get(_PAIR[op])
                if paired is None:
                    paired = _run_op(_PAIR[op], case.x, world_size)[case.lo : case.hi]
            agreed = _agreed_stats(op, case, first, second, mine, paired)
            probed = _probe_results(op, case, first, world_size)
            if op not in probe_bits:
                probe_bits[op] = probed
            elif not torch.equal(probed, probe_bits[op]):
                invariant[op] = False
            rows.append(_row(op, dtype_name, case, world_size, backend, agreed))
            if bar is not None:
                bar.update(1)
    for row in rows:  # invariance is a property of the whole size sweep
        row.size_invariant = invariant[row.op]
    return rows


def audit_rank(
    rank: int, world_size: int, config: AuditConfig, *, device: torch.device | str = "cpu", progress: bool = False
) -> list[AuditRow]:
    """Run the audit on this rank of an initialised default process group; every rank returns the same rows."""
    device = torch.device(device)
    backend = str(dist.get_backend())
    bar = None
    if progress and rank == 0:
        # the one bar rule of mixprec: drawn on a terminal only, never into a log
        total = len(config.dtypes) * len(config.sizes()) * len(config.ops)
        bar = progress_bar(total=total, desc="audit", unit="case")
    rows: list[AuditRow] = []
    try:
        for d_index in range(len(config.dtypes)):
            rows += _audit_dtype(rank, world_size, config, d_index, device, backend, bar)
    finally:
        if bar is not None:
            bar.close()
    return rows


# ---------------------------------------------------------------------------------------------- launching
def _forked_rank(rank: int, world_size: int, config: AuditConfig, progress: bool) -> list[AuditRow] | None:
    rows = audit_rank(rank, world_size, config, progress=progress)
    return rows if rank == 0 else None


def _torchrun_env() -> dict[str, int] | None:
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    try:
        return {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    except ValueError as exc:
        raise ValueError(f"torchrun environment variables must be integers ({exc})") from None


def check_launch(config: AuditConfig, *, nproc: int | None, backend: str, timeout: float) -> int | None:
    """Check how the audit is launched, before any process starts; returns the number of ranks to fork
    (None under torchrun). ValueError names the argument at fault."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl'; got {backend!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
    env = _torchrun_env()
    if env is not None:
        if nproc is not None:
            raise ValueError("--nproc cannot be used under torchrun (torchrun starts the ranks)")
        config.check_world_size(env["WORLD_SIZE"])
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, which is not available")
        return None
    if nproc is None:
        nproc = DEFAULT_NPROC
    if backend == "nccl":
        raise ValueError("--nproc forks gloo ranks on the CPU; run under torchrun for NCCL")
    if isinstance(nproc, int) and not isinstance(nproc, bool) and nproc > MAX_FORKED_RANKS:
        raise ValueError(f"--nproc forks at most {MAX_FORKED_RANKS} ranks on one machine; got {nproc}")
    config.check_world_size(nproc)
    return nproc


def run_audit(
    config: AuditConfig,
    *,
    nproc: int | None = None,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    progress: bool = False,
) -> list[AuditRow] | None:
    """Run the audit: as one rank of a torchrun job (RANK/WORLD_SIZE/LOCAL_RANK set) or on ``nproc`` forked gloo
    ranks. Everything is validated before any process starts or any collective runs. Returns the rows on rank 0
    (and from the launcher), None on the other torchrun ranks.

    Args:
        config: what to audit.
        nproc: ranks to fork (>= 2; None = ``DEFAULT_NPROC``); must be None under torchrun.
        backend: "auto" (NCCL when CUDA is available under torchrun, else gloo), "gloo" or "nccl".
        timeout: seconds for the process group (a hung collective raises) and for the forked run.
    """
    nproc = check_launch(config, nproc=nproc, backend=backend, timeout=timeout)
    env = _torchrun_env()
    if env is not None:
        use_nccl = backend == "nccl" or (backend == "auto" and torch.cuda.is_available())
        device = torch.device("cuda", env["LOCAL_RANK"]) if use_nccl else torch.device("cpu")
        if use_nccl:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if use_nccl else "gloo", timeout=timedelta(seconds=timeout))
        try:
            rows = audit_rank(env["RANK"], env["WORLD_SIZE"], config, device=device, progress=progress)
        finally:
            dist.destroy_process_group()
        return rows if env["RANK"] == 0 else None
    assert nproc is not None
    return run_distributed(_forked_rank, nproc, config, progress, timeout=float(timeout))[0]


# ---------------------------------------------------------------------------------------------- reporting
def _size_label(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def _flag(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def format_table(rows: list[AuditRow]) -> str:
    """Markdown table, one line per row."""
    head = (
        "| op | dtype | size | rel L2 | max abs | max rel | bits | correctly rounded | deterministic | "
        "size-invariant | ranks agree | = all_reduce |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r.op} | {r.dtype} | {_size_label(r.bytes)} | {r.rel_l2:.2e} | {r.max_abs:.2e} | {r.max_rel:.2e} | "
            f"{r.bits:.1f} | {r.correctly_rounded:.1%} | {_flag(r.deterministic)} | {_flag(r.size_invariant)} | "
            f"{_flag(r.ranks_agree)} | {_flag(r.matches_all_reduce)} |"
        )
    return "\n".join(lines)


def verdicts(rows: list[AuditRow]) -> list[str]:
    """One line per operation: the worst effective bits per dtype, and what the flags say."""
    out = []
    ops = list(dict.fromkeys(r.op for r in rows))
    for op in ops:
        mine = [r for r in rows if r.op == op]
        world, backend = mine[0].world_size, mine[0].backend
        parts = []
        for dtype in dict.fromkeys(r.dtype for r in mine):
            sel = [r for r in mine if r.dtype == dtype]
            bits, cr = min(r.bits for r in sel), min(r.correctly_rounded for r in sel)
            parts.append(f"{dtype} {bits:.1f} bits ({cr:.0%} correctly rounded)")
        text = f"{op} [{backend}, {world} ranks]: " + ", ".join(parts) + "; "
        flags = [
            "deterministic" if all(r.deterministic for r in mine) else "NOT deterministic",
            "size-invariant" if all(r.size_invariant for r in mine) else "NOT size-invariant",
        ]
        if op.startswith("all_reduce"):
            flags.append("ranks agree" if all(r.ranks_agree for r in mine) else "ranks DISAGREE")
        else:
            flags.append(
                f"matches {_PAIR[op]}" if all(r.matches_all_reduce for r in mine) else f"DIFFERS from {_PAIR[op]}"
            )
        text += ", ".join(flags)
        low = [r for r in mine if r.dtype != "fp32"]
        if low and not op.endswith("fp32_accumulate"):
            cr = min(r.correctly_rounded for r in low)
            if world == 2:
                text += (
                    "; 2 ranks add once per element, so a sum in the wire dtype cannot be told from an fp32 one: "
                    "audit with 3 or more ranks"
                )
            elif cr < 0.99:
                text += f"; bf16/fp16 summed in the wire dtype ({1 - cr:.0%} of the sums not correctly rounded)"
            else:
                text += "; bf16/fp16 sums correctly rounded (accumulated wider than the wire dtype)"
        elif low:
            text += "; one rounding of an fp32 sum"
        out.append(text)
    return out


def write_json(rows: list[AuditRow], path: Path, config: AuditConfig) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": asdict(config),
        "torch": torch.__version__,
        "rows": [asdict(r) for r in rows],
        "verdicts": verdicts(rows),
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def audit_citation(path: str | os.PathLike[str]) -> list[str]:
    """Markdown lines quoting the verdicts of a JSON written by :func:`write_json` (``audit_collectives.json`` of
    ``mixprec audit collectives``), for a report to cite the machine's own audit. ValueError in one line naming
    ``path`` when it is not such a file."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read an audit from {os.fspath(path)!r}: {' '.join(str(exc).split())}") from None
    verdict_lines = data.get("verdicts") if isinstance(data, dict) else None
    rows = data.get("rows") if isinstance(data, dict) else None
    if not (isinstance(verdict_lines, list) and verdict_lines and all(isinstance(v, str) for v in verdict_lines)):
        raise ValueError(f"{os.fspath(path)!r} is not a 'mixprec audit collectives' JSON (no list of verdicts)")
    first = rows[0] if isinstance(rows, list) and rows and isinstance(rows[0], dict) else {}
    where = ", ".join(
        part
        for part in (
            f"backend {first['backend']}" if "backend" in first else "",
            f"{first['world_size']} ranks" if "world_size" in first else "",
            f"torch {data['torch']}" if "torch" in data else "",
        )
        if part
    )
    head = (
        f"From `{os.path.basename(os.fspath(path))}`" + (f" ({where})" if where else "") + ", one line per operation:"
    )
    return [head, "", *(f"- {line}" for line in verdict_lines)]


def plot_rows(rows: list[AuditRow], path: Path) -> Path | None:
    """Effective bits against message size, one panel per dtype; None when matplotlib is not installed."""
    plt = pyplot(required=False)
    if plt is None:
        return None
    dtypes = list(dict.fromkeys(r.dtype for r in rows))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(4.5 * len(dtypes), 3.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for op in dict.fromkeys(r.op for r in rows):
            pts = sorted((r.bytes, r.bits) for r in rows if r.op == op and r.dtype == dtype)
            # reduce-scatter often equals its all-reduce exactly: dashed and hollow, so both stay visible
            scatter = op.startswith("reduce_scatter")
            style = {"linestyle": "--", "marker": "s", "fillstyle": "none"} if scatter else {"marker": "o"}
            ax.plot([p for p, _ in pts], [b for _, b in pts], label=op, **style)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message bytes per rank")
        ax.set_ylabel("effective bits, -log2(rel L2 error)")
        ax.set_title(f"{dtype}, {rows[0].world_size} ranks, {rows[0].backend}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    return save_figure(fig, path, dpi=110)
