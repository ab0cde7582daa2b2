"""mixprec study compression-error: which wire for which gradients.

Simulated ranks in one process run the flat compressed all-reduce (each rank's gradient quantized, fp32 sums
in rank order, the mean quantized once more) with each wire, and compare the result with the float64 mean:

* uint8: min-max 8-bit codes with a zero-aligned grid (MinMaxUInt8), 1 + 8/chunk bytes per element;
* uint8-min-grid: the previous grid (offset at the chunk minimum, zeros not exact), for comparison;
* e4m3, e5m2: fp8 codes with a power-of-two scale per chunk (ScaledFP8), 1 + 4/chunk bytes per element;
* mxfp8_e4m3, mxfp8_e5m2, mxfp4_e2m1, nvfp4: block-scaled codes with the scales inline (BlockScaledWire):
  8.25, 8.25, 4.25 and 4.5 + 32/chunk bits per element;
* bf16: a bf16 wire with fp32 sums and one rounding (the fp32-accumulating collective), 2 bytes per element.

Gradients: normal, heavy-tailed (Student-t, 2 degrees of freedom), sparse (90% of the elements zero on every
rank), outlier-heavy (0.1% of the elements 1000 times larger) and real ones: each rank's gradient of one
training step of the lab's small GPT on its own batch of random tokens. Columns: bytes per element, the
relative (2-norm) and mean error, the max error over the max magnitude, the worst ratio of error to its
theoretical bound (at most 1), the share of exact zeros of the mean kept exactly zero. Bounds and results:
docs/compress.md. Run time on 2 busy cores: --quick about 2 s, the defaults under 10 s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from mixprec.compress import BlockScaledWire, MinMaxUInt8, ScaledFP8
from mixprec.compress.blockscaled import BLOCK_WIRES
from mixprec.compress.options import DEFAULT_CHUNK_SIZE
from mixprec.core.validate import check_positive_int
from mixprec.emulate import round_to
from mixprec.lab.model import GPT, GPTConfig
from mixprec.lab.studies.base import DEFAULT_SEED, StudyOutput, pyplot, save_figure, write_rows_csv, wrote_lines

__all__ = [
    "DISTRIBUTIONS",
    "FULL_MODEL_WIDTH",
    "QUICK",
    "WIRES",
    "CompressionErrorConfig",
    "CompressionErrorRow",
    "draw_gradients",
    "format_table",
    "plot_errors",
    "run",
    "run_study",
    "simulate",
    "write_csv",
]

WIRES = ("uint8", "uint8-min-grid", "e4m3", "e5m2", *BLOCK_WIRES, "bf16")
DISTRIBUTIONS = ("normal", "student-t", "sparse", "outliers", "model")
_U32 = 2.0**-24
# --quick: a few seconds. The command line's full run measures a wider model's gradients than the config's default.
QUICK = {"world": 4, "elements": 8192, "chunk_size": 256, "model_width": 32}
FULL_MODEL_WIDTH = 128


@dataclass(frozen=True)
class CompressionErrorConfig:
    """world ranks, elements per rank (a multiple of world * chunk_size; the model's gradient is padded),
    chunk_size, wires, distributions, seed."""

    world: int = 8
    elements: int = 1 << 18
    chunk_size: int = DEFAULT_CHUNK_SIZE
    wires: tuple[str, ...] = WIRES
    distributions: tuple[str, ...] = DISTRIBUTIONS
    model_width: int = 64
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        check_positive_int("world", self.world, minimum=2)
        check_positive_int("chunk_size", self.chunk_size)
        check_positive_int("elements", self.elements)
        check_positive_int("model_width", self.model_width)
        if self.elements % (self.world * self.chunk_size):
            raise ValueError(
                f"elements ({self.elements}) must be a multiple of world * chunk_size ({self.world * self.chunk_size})"
            )
        for name, values, allowed in (
            ("wires", self.wires, WIRES),
            ("distributions", self.distributions, DISTRIBUTIONS),
        ):
            bad = [v for v in values if v not in allowed]
            if not values or bad:
                raise ValueError(f"{name} must be names from {', '.join(allowed)}; got {values!r}")


@dataclass(frozen=True)
class CompressionErrorRow:
    distribution: str
    wire: str
    bytes_per_element: float
    rel_error: float
    mean_error: float
    max_error: float
    error_over_bound: float
    zeros_kept: float


def _model_gradients(world: int, width: int, seed: int) -> torch.Tensor:
    """[world, P]: each rank's fp32 gradient of one step of a small GPT on its own random tokens."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=width))
    grads = []
    for rank in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        idx = torch.randint(0, 65, (4, 32), generator=g)
        model.zero_grad(set_to_none=True)
        _, loss = model(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
    return torch.stack(grads)


def draw_gradients(
    distribution: str, world: int, elements: int, seed: int, model_width: int = 64, multiple: int = 1
) -> torch.Tensor:
    """[world, elements] fp32 gradients; the model's: all of them, zero-padded to a multiple of ``multiple``."""
    g = torch.Generator().manual_seed(seed)
    shape = (world, elements)
    if distribution == "normal":
        return torch.randn(shape, generator=g) * 1e-3
    if distribution == "student-t":
        normal = torch.randn(shape, generator=g)
        chi2 = torch.randn((2, *shape), generator=g).square().sum(0)  # 2 degrees of freedom
        return normal / (chi2 / 2).sqrt() * 1e-3
    if distribution == "sparse":
        mask = torch.rand(elements, generator=g) < 0.1  # the same rows on every rank (absent tokens)
        return torch.randn(shape, generator=g) * 1e-3 * mask
    if distribution == "outliers":
        x = torch.randn(shape, generator=g) * 1e-3
        hot = torch.rand(shape, generator=g) < 1e-3
        return torch.where(hot, x * 1000, x)
    grads = _model_gradients(world, model_width, seed)
    padded = -(-grads.shape[1] // multiple) * multiple
    return torch.nn.functional.pad(grads, (0, padded - grads.shape[1]))


def _uint8_bound(comp: MinMaxUInt8, v: torch.Tensor) -> torch.Tensor:
    """Per-element bound of one uint8 round trip of ``v`` (docs/compress.md): half a step plus fp32 terms."""
    c = comp.chunk_size
    chunks = v.view(-1, c)
    mins, maxs = chunks.amin(1), chunks.amax(1)
    _, _, _, _, _, step = MinMaxUInt8.grid(mins, maxs)
    big = torch.maximum(mins.abs(), maxs.abs()).double()
    s = step.double()
    per_chunk = 0.5 * s + 6.1 * _U32 * 255 * s + 1.1 * _U32 * big + 2.0**-150
    return per_chunk.repeat_interleave(c)


def _fp8_bound(comp: ScaledFP8, v: torch.Tensor) -> torch.Tensor:
    c = comp.chunk_size
    k = comp.chunk_scales(v.view(-1, c).abs().amax(1))
    scale = torch.exp2(-k).repeat_interleave(c)
    fmt = comp.format
    sub = 2.0 ** (fmt.emin - fmt.man_bits)
    return torch.maximum(fmt.unit_roundoff * v.double().abs(), sub / 2 * scale)


def _block_bound(comp: BlockScaledWire, v: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """One block-scaled round trip of ``v`` errs by at most ``u_e |x|`` or half the element grid's subnormal
    spacing times the block's decoded scale (docs/compress.md); ``2**-20`` covers the fp32 product with
    NVFP4's reciprocal scale."""
    grid = comp.format.element
    u = 2.0 ** -(grid.man_bits + 1)
    sub = 2.0 ** (grid.emin - grid.man_bits)
    scale = comp.block_scales(buffer, v.numel()).double().repeat_interleave(comp.block)[: v.numel()]
    return u * (1 + 2.0**-20) * v.double().abs() + sub / 2 * scale + 2.0**-149


def _min_grid_roundtrip(v: torch.Tensor, chunk: int) -> torch.Tensor:
    """The previous uint8 grid, in float64: offset at the chunk minimum, step R / 255."""
    x = v.double().view(-1, chunk)
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    step = (hi - lo) / 255
    codes = torch.where(step > 0, ((x - lo) / torch.where(step > 0, step, 1)).round(), torch.zeros_like(x))
    return (lo + codes * step).float().view(-1)


def simulate(grads: torch.Tensor, wire: str, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The flat all-reduce (mean) of ``grads`` [W, N] with ``wire``: (result fp32, per-element bound, bytes/elem)."""
    world = grads.shape[0]
    if wire == "bf16":

        def roundtrip(v: torch.Tensor) -> torch.Tensor:
            return round_to(v, "bf16")

        def bound(v: torch.Tensor) -> torch.Tensor:
            return 2.0**-8 * v.double().abs() + 2.0**-134

        nbytes = 2.0
    elif wire == "uint8-min-grid":

        def roundtrip(v: torch.Tensor) -> torch.Tensor:
            return _min_grid_roundtrip(v, chunk_size)

        def bound(v: torch.Tensor) -> torch.Tensor:
            x = v.double().view(-1, chunk_size)
            return ((x.amax(1) - x.amin(1)) / 510 * (1 + 1e-6) + 2.0**-150).repeat_interleave(chunk_size)

        nbytes = 1 + 8 / chunk_size
    elif wire in BLOCK_WIRES:
        block = BlockScaledWire(wire, chunk_size=chunk_size, check_finite="flag")

        def roundtrip(v: torch.Tensor) -> torch.Tensor:
            return block.decode(block.encode(v), v.numel())

        def bound(v: torch.Tensor) -> torch.Tensor:
            return _block_bound(block, v, block.encode(v))

        nbytes = block.encoded_nbytes(grads.shape[1]) / grads.shape[1]
    else:
        comp = MinMaxUInt8(chunk_size=chunk_size) if wire == "uint8" else ScaledFP8(wire, chunk_size=chunk_size)

        def roundtrip(v: torch.Tensor) -> torch.Tensor:
            return comp.decode(comp.encode(v), v.numel())

        def bound(v: torch.Tensor) -> torch.Tensor:
            return _uint8_bound(comp, v) if isinstance(comp, MinMaxUInt8) else _fp8_bound(comp, v)

        nbytes = comp.encoded_nbytes(grads.shape[1]) / grads.shape[1]
    acc = roundtrip(grads[0])
    worker = bound(grads[0])
    absum = acc.double().abs()
    for r in range(1, world):
        dec = roundtrip(grads[r])
        acc = acc + dec  # fp32, rank order
        worker = worker + bound(grads[r])
        absum = absum + dec.double().abs()
    mean = acc / world
    # fp32 sums (gamma_{W-1}) and the division: (W + 1) u of the sum of magnitudes, over W.
    summing = (world + 1) * _U32 * absum / world * 1.01
    return roundtrip(mean), worker / world + summing + bound(mean), nbytes


def run_study(config: CompressionErrorConfig, *, progress: bool = False) -> list[CompressionErrorRow]:
    rows = []
    for i, dist_name in enumerate(config.distributions):
        grads = draw_gradients(
            dist_name,
            config.world,
            config.elements,
            config.seed * 101 + i,
            config.model_width,
            config.world * config.chunk_size,
        )
        exact = grads.double().mean(0)
        zeros = exact == 0
        for wire in config.wires:
            result, bound, nbytes = simulate(grads, wire, config.chunk_size)
            err = result.double() - exact
            rows.append(
                CompressionErrorRow(
                    dist_name,
                    wire,
                    nbytes,
                    float(torch.linalg.vector_norm(err) / torch.linalg.vector_norm(exact)),
                    float(err.abs().mean() / exact.abs().mean()),
                    float(err.abs().max() / exact.abs().max()),
                    float((err.abs() / bound).max()),
                    float((result[zeros] == 0).double().mean()) if zeros.any() else float("nan"),
                )
            )
        if progress:
            print(f"  {dist_name} done", flush=True)
    return rows


def format_table(rows: list[CompressionErrorRow]) -> str:
    lines = [
        "| gradients | wire | bytes/elem | bits/elem | rel. error | mean error | max error | error/bound "
        "| zeros kept |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        kept = "-" if r.zeros_kept != r.zeros_kept else f"{100 * r.zeros_kept:.0f}%"
        lines.append(
            f"| {r.distribution} | {r.wire} | {r.bytes_per_element:.3f} | {8 * r.bytes_per_element:.3f} | "
            f"{r.rel_error:.2e} | {r.mean_error:.2e} | "
            f"{r.max_error:.2e} | "
            f"{r.error_over_bound:.2f} | {kept} |"
        )
    return "\n".join(lines)


def write_csv(rows: list[CompressionErrorRow], path: Path) -> Path:
    return write_rows_csv(rows, path)


def plot_errors(rows: list[CompressionErrorRow], path: Path) -> Path:
    """Relative error per wire, one group of bars per gradient distribution (needs matplotlib)."""
    plt = pyplot()
    dists = list(dict.fromkeys(r.distribution for r in rows))
    wires = list(dict.fromkeys(r.wire for r in rows))
    by = {(r.distribution, r.wire): r.rel_error for r in rows}
    fig, ax = plt.subplots(figsize=(1.6 * len(dists) + 2, 4))
    width = 0.8 / len(wires)
    for j, wire in enumerate(wires):
        ax.bar([i + j * width for i in range(len(dists))], [by[d, wire] for d in dists], width, label=wire)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(dists))], dists)
    ax.set_yscale("log")
    ax.set_ylabel("relative error vs float64 mean")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- the run
def run(config: CompressionErrorConfig, output: StudyOutput) -> int:
    """``mixprec study compression-error``: measure, print the table, write ``compression_error.csv`` (and
    ``compression_error.png``)."""
    print(
        f"compression-error: {config.world} ranks, {config.elements} elements per rank, chunks of "
        f"{config.chunk_size}, wires {config.wires}, gradients {config.distributions}, seed {config.seed}",
        flush=True,
    )
    rows = run_study(config, progress=True)
    print("\nFlat all-reduce (mean) against the float64 mean; error/bound <= 1 is the theory holding:\n")
    print(format_table(rows))
    written = [write_csv(rows, output.path("compression_error.csv"))]
    if output.plot:
        written.append(plot_errors(rows, output.path("compression_error.png")))
    print(wrote_lines(written))
    return 0
