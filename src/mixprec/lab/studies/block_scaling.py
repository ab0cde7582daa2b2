"""mixprec study block-scaling: which scale mode for which tensor, measured beside the error bounds.

Every block-scaled format (MXFP8 e4m3/e5m2, MXFP6 e2m3/e3m2, MXFP4 e2m1 with E8M0 scales; NVFP4 with and
without its fp32 tensor scale) and every scale mode of :func:`mixprec.emulate.mx_quantize` (``floor`` of OCP MX
v1.0, torchao's ``ceil``, ``even`` and ``rceil``, AWS Neuron's doubled scale ``neuron``) quantizes five kinds of
tensor, blocks along the last dimension: normal, heavy-tailed (Student-t), outlier-heavy (normal with a few
channels x100) and real activations and gradients captured from a few training steps of the lab's small GPT
on the built-in corpus. Per (tensor, format, mode): the relative 2-norm error against float64, the largest
error in a block over that block's absolute maximum, the share of blocks that clip (an element beyond the
largest element after scaling) and of nonzero elements flushed to zero, and beside them the error bound
``u_e ||x|| + underflow + kappa_mode ||x_clipped||`` derived in docs/block_scaling.md. The recommendation per
tensor is computed from these rows (:func:`recommend`): the mode with the lowest error among those whose
clipping changes no value. Run time: the defaults take about 30 s of CPU time.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from mixprec.core.mx import E8M0_MODES, BlockFormat
from mixprec.core.validate import check_positive_int
from mixprec.emulate import MX_FORMATS, SCALE_MODES, mx_quantize
from mixprec.lab.corpus import load_corpus
from mixprec.lab.data import train_microbatches
from mixprec.lab.model import GPT, GPTConfig
from mixprec.lab.studies.base import DEFAULT_SEED, StudyOutput, pyplot, save_figure, write_rows_csv, wrote_lines

__all__ = [
    "FORMATS",
    "MODES",
    "QUICK",
    "TENSOR_KINDS",
    "BlockScalingConfig",
    "BlockScalingRow",
    "Recommendation",
    "capture_tensors",
    "clip_kappa",
    "element_bound",
    "format_recommendations",
    "format_table",
    "measure",
    "plot_errors",
    "read_csv",
    "recommend",
    "run",
    "saturates",
    "run_study",
    "synthetic_tensor",
    "write_csv",
]

FORMATS: tuple[str, ...] = tuple(MX_FORMATS)
MODES: tuple[str, ...] = SCALE_MODES
TENSOR_KINDS: tuple[str, ...] = ("normal", "student-t", "outliers", "activations", "gradients")
QUICK = {"rows": 64, "channels": 256, "model_width": 32, "model_steps": 2}  # seconds: ``--quick``
TWO_LEVEL = "e4m3+tensor"  # NVFP4 under the fp32 tensor scale amax(x) / (448 * 6) of arXiv 2509.25149
_FP32_SLACK = 2.0**-20  # the fp32 roundings of NVFP4's reciprocal scale, product and decode (a few 2**-24)
_E4M3_UNIT_ROUNDOFF = 2.0**-4
_E4M3_MAX = 448.0


@dataclass(frozen=True)
class BlockScalingConfig:
    """rows x channels of each synthetic tensor (blocks along the channels); formats, scale modes (``e4m3``
    runs NVFP4 with and without the tensor scale) and tensor kinds; Student-t degrees of freedom; outlier
    channels (x ``outlier_factor``); the GPT's width and training steps before the capture; seed."""

    rows: int = 512
    channels: int = 1024
    formats: tuple[str, ...] = FORMATS
    modes: tuple[str, ...] = MODES
    tensors: tuple[str, ...] = TENSOR_KINDS
    dof: int = 3
    outlier_channels: int = 4
    outlier_factor: float = 100.0
    model_width: int = 64
    model_steps: int = 8
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        for name in ("rows", "channels", "dof", "outlier_channels", "model_width"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("model_steps", self.model_steps, minimum=0)
        for name, values, allowed in (
            ("formats", self.formats, FORMATS),
            ("modes", self.modes, MODES),
            ("tensors", self.tensors, TENSOR_KINDS),
        ):
            bad = [v for v in values if v not in allowed]
            if not values or bad:
                raise ValueError(f"{name} must be names from {', '.join(allowed)}; got {values!r}")
        if not self.configurations():
            raise ValueError(
                f"modes {self.modes!r} apply to none of formats {self.formats!r} (E8M0 formats take "
                f"{', '.join(E8M0_MODES)}; nvfp4 takes e4m3)"
            )
        block = max(MX_FORMATS[f].block_size for f in self.formats)
        if self.channels % block:
            raise ValueError(f"channels ({self.channels}) must be a multiple of the block size {block}")
        if self.outlier_channels > self.channels:
            raise ValueError(f"outlier_channels ({self.outlier_channels}) exceeds channels ({self.channels})")
        if self.model_width % block:
            raise ValueError(f"model_width ({self.model_width}) must be a multiple of the block size {block}")
        if not (math.isfinite(self.outlier_factor) and self.outlier_factor > 0):
            raise ValueError(f"outlier_factor must be positive and finite; got {self.outlier_factor!r}")

    def configurations(self) -> list[tuple[str, str]]:
        """(format, mode) pairs to run, in the order given; NVFP4's ``e4m3`` yields both scalings."""
        out = []
        for fmt in self.formats:
            if MX_FORMATS[fmt].scale == "e4m3":
                if "e4m3" in self.modes:
                    out += [(fmt, "e4m3"), (fmt, TWO_LEVEL)]
            else:
                out += [(fmt, m) for m in self.modes if m in E8M0_MODES]
        return out


@dataclass(frozen=True)
class BlockScalingRow:
    kind: str
    tensor: str
    format: str
    mode: str
    block: int
    rel_l2: float  # ||q(x) - x|| / ||x||, float64
    bound_l2: float  # round_term + underflow_term + clip_term (docs/block_scaling.md)
    clip_term: float  # kappa_mode ||x_clipped|| / ||x||
    underflow_term: float  # ||min(s_e X / 2, |x|) over elements below the normal range|| / ||x||
    max_block_rel: float  # max over blocks of max |error| / block amax
    max_block_bound: float  # the same for the per-element bound
    clip_blocks: float  # share of blocks with an element beyond max_element after scaling
    sat_blocks: float  # share of blocks where saturation changed a value round-to-nearest would have given
    flushed: float  # share of nonzero elements that decode to zero
    err_over_bound: float  # max over elements of |error| / bound (<= 1 is the theory holding)


# ---------------------------------------------------------------------------------------------- the bound
def clip_kappa(fmt: BlockFormat, mode: str) -> float:
    """Largest relative error ``(|x| - M X) / |x|`` of an element that ``mode`` can clip, in exact arithmetic plus
    the fp32 roundings of the scale: ``1 - sigma / 2`` for ``floor`` (``sigma = M / 2**emax_elem``), ``1 - sigma /
    (2 - 2**-(m+1))`` for ``even``, 0 for ``ceil`` and ``neuron``, ``2**-24`` for ``rceil`` (its fp32 quotient) and
    E4M3's unit roundoff for NVFP4 (unless its block scale is clamped at 448: see :func:`element_bound`)."""
    sigma = fmt.max_element / 2.0**fmt.emax
    if mode == "floor":
        return 1.0 - sigma / 2.0
    if mode == "even":
        return max(0.0, 1.0 - sigma / (2.0 - 2.0 ** -(fmt.element.man_bits + 1)))
    if mode in ("ceil", "neuron"):
        return 0.0
    if mode == "rceil":
        return 2.0**-24
    if mode in ("e4m3", TWO_LEVEL):
        return _E4M3_UNIT_ROUNDOFF + _FP32_SLACK
    raise ValueError(f"mode must be one of {', '.join(MODES)} or {TWO_LEVEL!r}; got {mode!r}")


@dataclass(frozen=True)
class _Quantized:
    x: torch.Tensor  # float64 [..., blocks, block]
    q: torch.Tensor  # float64 decoded, same shape
    scale: torch.Tensor  # float64 decoded scale X per block [..., blocks, 1]
    clipped: torch.Tensor  # bool, |x| > M X
    saturated: torch.Tensor  # bool, |x| / X at or beyond the midpoint above M: saturation changed the value
    bound: torch.Tensor  # float64 per-element bound
    terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rounding, underflow, clipping parts of bound


def _quantize(x: torch.Tensor, fmt_name: str, mode: str) -> _Quantized:
    fmt = MX_FORMATS[fmt_name]
    ts = None
    if mode == TWO_LEVEL:
        amax = float(x.abs().max())
        ts = amax / (_E4M3_MAX * fmt.max_element) if amax > 0 else None
    q = mx_quantize(x, fmt_name, scale_mode="e4m3" if mode == TWO_LEVEL else mode, tensor_scale=ts)
    b = fmt.block_size
    decoded = q.dequantize().double().reshape(*x.shape[:-1], -1, b)
    scale = q.scales if q.tensor_scale is None else q.tensor_scale * q.scales  # fp32, as dequantize() has it
    scale = scale.double().unsqueeze(-1)
    xb = x.double().reshape(*x.shape[:-1], -1, b)
    bound, terms, clipped = element_bound(xb, scale, fmt, mode, None if ts is None else float(q.tensor_scale))
    return _Quantized(xb, decoded, scale, clipped, saturates(xb, scale, fmt), bound, terms)


def saturates(x: torch.Tensor, scale: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """Elements whose saturation changed the result: ``|x| / X`` at or beyond the midpoint between the largest
    element ``M`` and the next value of the unbounded grid, ``M + 2**(emax_elem - m - 1)`` (at it exactly, only
    if ``M``'s significand is odd: the tie then rounds away from ``M``). Below it round-to-nearest gives ``M``
    with or without saturation."""
    half = 2.0 ** (fmt.emax - fmt.element.man_bits - 1)
    mid = (fmt.max_element + half) * scale
    odd = int(fmt.max_element / (2 * half)) % 2 == 1
    return x.abs() >= mid if odd else x.abs() > mid


def element_bound(
    x: torch.Tensor, scale: torch.Tensor, fmt: BlockFormat, mode: str, tensor_scale: float | None = None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Per-element error bound of one block-scaled round trip (docs/block_scaling.md): ``x`` float64
    ``[..., blocks, block]``, ``scale`` the decoded scale per block ``[..., blocks, 1]``. Returns (bound, its
    (rounding, underflow, clipping) parts, the clipped elements ``|x| > M X``)."""
    grid = fmt.element
    u = 2.0 ** -(grid.man_bits + 1)
    sub = 2.0 ** (grid.emin - grid.man_bits)  # the element grid's subnormal spacing
    ax = x.abs()
    limit = fmt.max_element * scale
    clipped = ax > limit
    kappa = torch.full_like(scale, clip_kappa(fmt, mode))
    if fmt.scale == "e4m3":
        # a block scale amax / 6 / t above E4M3's 448 is clamped to it: nothing bounds the clipping but |x|
        amax = ax.amax(-1, keepdim=True)
        kappa = torch.where(amax / fmt.max_element / (tensor_scale or 1.0) > _E4M3_MAX, 1.0, kappa)
    rounding = (u + _FP32_SLACK) * ax + 2.0**-149  # 2**-149: a decode P * X landing in fp32's subnormals
    # below the element's normal range the grid spacing is s_e X; 0 is on the grid, so never more than |x| either
    below = ax < 2.0**grid.emin * scale * (1 + _FP32_SLACK)
    underflow = torch.where(below, torch.minimum(sub / 2 * scale, ax) * (1 + _FP32_SLACK), 0.0)
    clipping = torch.where(clipped, kappa * ax, 0.0)
    if mode == "rceil":
        # Transformer Engine's exp2f_rcp: a 2**-127 scale multiplies by 1, so such blocks decode to zeros
        clipping = torch.where(scale == 2.0**-127, ax, clipping)
    return rounding + underflow + clipping, (rounding, underflow, clipping), clipped


def measure(x: torch.Tensor, fmt: str, mode: str, *, kind: str = "", tensor: str = "") -> BlockScalingRow:
    """One row: quantize fp32 ``x`` (2-D, blocks along the last dim) and compare it with float64."""
    if x.dim() != 2 or not bool(torch.isfinite(x).all()) or not bool((x != 0).any()):
        raise ValueError(f"x must be a 2-D tensor of finite values, not all zero; got shape {tuple(x.shape)}")
    r = _quantize(x, fmt, mode)
    err = (r.q - r.x).abs()
    norm = float(torch.linalg.vector_norm(r.x))
    amax = r.x.abs().amax(-1)
    live = amax > 0
    rounding, underflow, clipping = (float(torch.linalg.vector_norm(t)) / norm for t in r.terms)
    nonzero = r.x != 0
    return BlockScalingRow(
        kind=kind,
        tensor=tensor,
        format=fmt,
        mode=mode,
        block=MX_FORMATS[fmt].block_size,
        rel_l2=float(torch.linalg.vector_norm(r.q - r.x)) / norm,
        bound_l2=rounding + underflow + clipping,
        clip_term=clipping,
        underflow_term=underflow,
        max_block_rel=float((err.amax(-1)[live] / amax[live]).max()),
        max_block_bound=float((r.bound.amax(-1)[live] / amax[live]).max()),
        clip_blocks=float(r.clipped.any(-1).double().mean()),
        sat_blocks=float(r.saturated.any(-1).double().mean()),
        flushed=float(((r.q == 0) & nonzero).sum() / nonzero.sum().clamp(min=1)),
        err_over_bound=float((err / r.bound).max()),
    )


# ---------------------------------------------------------------------------------------------- tensors
def synthetic_tensor(kind: str, config: BlockScalingConfig, seed: int) -> tuple[str, torch.Tensor]:
    """(description, fp32 [rows, channels]) for ``normal``, ``student-t`` or ``outliers``."""
    g = torch.Generator().manual_seed(seed)
    shape = (config.rows, config.channels)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "normal":
        return f"N(0,1) {config.rows}x{config.channels}", x.float()
    if kind == "student-t":
        chi2 = torch.randn((config.dof, *shape), generator=g, dtype=torch.float64).square().sum(0)
        return f"Student-t {config.dof} dof {config.rows}x{config.channels}", (x / (chi2 / config.dof).sqrt()).float()
    if kind == "outliers":
        hot = torch.randperm(config.channels, generator=g)[: config.outlier_channels]
        x[:, hot] *= config.outlier_factor
        return (
            f"N(0,1) {config.rows}x{config.channels}, {config.outlier_channels} channels x{config.outlier_factor:g}",
            x.float(),
        )
    raise ValueError(f"kind must be one of normal, student-t, outliers; got {kind!r}")


def capture_tensors(width: int, steps: int, seed: int) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, description, fp32 2-D tensor) of the lab's GPT (2 layers, ``width`` channels, 16 sequences of 64
    characters of the built-in corpus per step) after ``steps`` Adam steps (lr 1e-3): the inputs of the last
    block's attention (layer-norm output) and MLP down-projection (GELU output), the gradient at the MLP
    up-projection's output and that layer's weight gradient. Blocks run along each tensor's last dimension."""
    corpus = load_corpus("stdlib")
    block_size, batch = 64, 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=block_size, n_layer=2, n_head=4, n_embd=width))
    last = len(model.blocks) - 1
    blk = model.blocks[last]
    params = list(model.parameters())
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    seen: dict[str, torch.Tensor] = {}

    def keep_input(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            seen[name] = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).clone()

        return hook

    def keep_output_grad(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        output.register_hook(lambda g: seen.__setitem__("fc_out_grad", g.detach().reshape(-1, g.shape[-1]).clone()))

    for step in range(steps + 1):
        ((idx, targets),) = train_microbatches(
            corpus.train, seed=seed, step=step, global_batch_size=batch, micro_batch_size=batch,
            block_size=block_size, rank=0, world_size=1,
        )  # fmt: skip
        handles = []
        if step == steps:
            handles = [
                blk.attn.c_attn.register_forward_hook(keep_input("attn_in")),
                blk.mlp.c_proj.register_forward_hook(keep_input("proj_in")),
                blk.mlp.c_fc.register_forward_hook(keep_output_grad),
            ]
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        for h in handles:
            h.remove()
        if step < steps:
            _adam_step(params, moments, step + 1)
    tokens = f"{batch}x{block_size} tokens after {steps} steps"
    prefix = f"blocks.{last}"
    named = [
        ("activations", f"{prefix}.attn.c_attn input (LN out)", seen["attn_in"]),
        ("activations", f"{prefix}.mlp.c_proj input (GELU out)", seen["proj_in"]),
        ("gradients", f"{prefix}.mlp.c_fc output grad", seen["fc_out_grad"]),
        ("gradients", f"{prefix}.mlp.c_fc.weight grad", blk.mlp.c_fc.weight.grad.detach().clone()),
    ]
    return [(kind, f"{name} {tuple(t.shape)}, {tokens}", t) for kind, name, t in named]


def _adam_step(params: list[torch.Tensor], moments: list[tuple[torch.Tensor, torch.Tensor]], t: int) -> None:
    """One Adam step (lr 1e-3, betas 0.9 and 0.999, eps 1e-8), written out: ``torch.optim`` imports the compiler
    stack on first use, seconds of the study's run time on a small CPU."""
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    with torch.no_grad():
        for p, (m, v) in zip(params, moments, strict=True):
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v / (1 - b2**t)).sqrt_().add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1**t))


def _tensors(config: BlockScalingConfig) -> list[tuple[str, str, torch.Tensor]]:
    out = []
    for kind in config.tensors:
        if kind not in ("activations", "gradients"):  # each kind its own seed, whichever others run
            out.append((kind, *synthetic_tensor(kind, config, config.seed * 101 + TENSOR_KINDS.index(kind))))
    if "activations" in config.tensors or "gradients" in config.tensors:
        captured = capture_tensors(config.model_width, config.model_steps, config.seed)
        out += [c for c in captured if c[0] in config.tensors]
    return out


def run_study(config: BlockScalingConfig, *, progress: bool = False) -> list[BlockScalingRow]:
    rows = []
    for kind, name, x in _tensors(config):
        for fmt, mode in config.configurations():
            rows.append(measure(x, fmt, mode, kind=kind, tensor=name))
        if progress:
            print(f"  {name} done", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------- the verdict
@dataclass(frozen=True)
class Recommendation:
    """The mode to pick for one (tensor, format): ``mode`` (with ``tied``, modes with the same error), from
    ``rows``; ``note`` says what the others cost (derived from the rows, not written by hand)."""

    tensor: str
    format: str
    mode: str
    tied: tuple[str, ...]
    rel_l2: float
    note: str


def recommend(rows: list[BlockScalingRow]) -> list[Recommendation]:
    """Per (tensor, format): the mode with the lowest ``rel_l2`` among those in which saturation changed no value
    (``sat_blocks == 0``: blocks may exceed the largest element, ``clip_blocks``, only by less than rounding to
    nearest would have moved them anyway); if every mode saturates, the lowest ``rel_l2``. Ties: modes with an
    equal error."""
    out = []
    groups: dict[tuple[str, str], list[BlockScalingRow]] = {}
    for r in rows:
        groups.setdefault((r.tensor, r.format), []).append(r)
    for (tensor, fmt), group in groups.items():
        clean = [r for r in group if r.sat_blocks == 0]
        best = min(clean or group, key=lambda r: r.rel_l2)
        tied = tuple(
            r.mode for r in group if r is not best and (r.sat_blocks == 0) == bool(clean) and r.rel_l2 == best.rel_l2
        )
        notes = [f"clips {best.clip_blocks:.1%} of blocks, within rounding"] if best.clip_blocks > 0 else []
        if not clean:
            notes.append("every mode saturates some block")
        for r in group:
            if r is best or r.mode in tied:
                continue
            note = f"{r.mode} {r.rel_l2 / best.rel_l2:.2f}x the error"
            if r.clip_blocks > 0:
                note += (
                    f", clips {r.clip_blocks:.1%} of blocks ({r.sat_blocks:.1%} beyond rounding), worst block "
                    f"{r.max_block_rel:.2e} vs {best.max_block_rel:.2e}"
                )
            if r.flushed > max(2 * best.flushed, 0.01):
                note += f", flushes {r.flushed:.1%} to zero"
            notes.append(note)
        out.append(Recommendation(tensor, fmt, best.mode, tied, best.rel_l2, "; ".join(notes)))
    return out


def format_recommendations(rows: list[BlockScalingRow]) -> str:
    """:func:`recommend` as text: per tensor, which mode for which format (among tied modes, the one tied best
    for the most formats, then the one with the smallest summed error ratio over the formats), then one line per
    format with what the other modes cost."""
    recs = recommend(rows)
    lines = []
    for tensor in dict.fromkeys(r.tensor for r in recs):
        mine = [r for r in recs if r.tensor == tensor]
        best = {r.format: r.rel_l2 for r in mine}
        count: dict[str, int] = {}
        ratio: dict[str, float] = {}
        for r in rows:
            if r.tensor == tensor:
                ratio[r.mode] = ratio.get(r.mode, 0.0) + r.rel_l2 / best[r.format]
        for r in mine:
            for m in (r.mode, *r.tied):
                count[m] = count.get(m, 0) + 1
        by_mode: dict[str, list[str]] = {}
        for r in mine:
            pick = max((r.mode, *r.tied), key=lambda m: (count[m], -ratio[m]))
            by_mode.setdefault(pick, []).append(r.format)
        lines.append(f"{tensor}\n  pick " + "; ".join(f"{m} for {', '.join(f)}" for m, f in by_mode.items()))
        for r in mine:
            same = f" (= {', '.join(r.tied)})" if r.tied else ""
            lines.append(f"  {r.format}: {r.mode}{same}, rel. error {r.rel_l2:.2e}; {r.note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- output
def format_table(rows: list[BlockScalingRow]) -> str:
    lines = [
        "| tensor | format | mode | rel. error | bound | clip term | worst block | its bound | blocks clipping "
        "| beyond rounding | flushed | error/bound |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.kind} | {r.format} | {r.mode} | {r.rel_l2:.2e} | {r.bound_l2:.2e} | {r.clip_term:.1e} | "
            f"{r.max_block_rel:.2e} | {r.max_block_bound:.2e} | {r.clip_blocks:.1%} | {r.sat_blocks:.1%} | "
            f"{r.flushed:.1%} | {r.err_over_bound:.2f} |"
        )
    return "\n".join(lines)


def write_csv(rows: list[BlockScalingRow], path: Path) -> Path:
    return write_rows_csv(rows, path)  # floats as repr: read_csv gets the same numbers back


def read_csv(path: Path) -> list[BlockScalingRow]:
    """The rows of :func:`write_csv`, exactly."""
    types = {fl.name: fl.type for fl in fields(BlockScalingRow)}
    cast = {"str": str, "int": int, "float": float}
    with Path(path).open(newline="") as f:
        return [BlockScalingRow(**{k: cast[types[k]](v) for k, v in row.items()}) for row in csv.DictReader(f)]


def plot_errors(rows: list[BlockScalingRow], path: Path) -> Path:
    """One panel per tensor: relative error per format and mode (hatched where blocks clip), the bound as a
    black tick over each bar (needs matplotlib)."""
    plt = pyplot()
    tensors = list(dict.fromkeys(r.tensor for r in rows))
    formats = list(dict.fromkeys(r.format for r in rows))
    modes = list(dict.fromkeys(r.mode for r in rows))
    colors = {m: f"C{i}" for i, m in enumerate(modes)}
    by = {(r.tensor, r.format, r.mode): r for r in rows}
    fig, axes = plt.subplots(len(tensors), 1, figsize=(10, 2.4 * len(tensors) + 0.6), squeeze=False)
    width = 0.8 / max(sum(1 for m in modes if (tensors[0], f, m) in by) for f in formats)
    for ax, tensor in zip(axes[:, 0], tensors, strict=True):
        for i, fmt in enumerate(formats):
            present = [m for m in modes if (tensor, fmt, m) in by]
            for j, mode in enumerate(present):
                r = by[tensor, fmt, mode]
                x = i + (j - (len(present) - 1) / 2) * width
                ax.bar(x, r.rel_l2, width, color=colors[mode], hatch="//" if r.sat_blocks > 0 else None)
                ax.plot([x - width / 2, x + width / 2], [r.bound_l2] * 2, color="k", lw=1)
        ax.set_xticks(range(len(formats)), formats)
        ax.set_yscale("log")
        ax.set_title(tensor, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[m]) for m in modes]
    handles.append(plt.Rectangle((0, 0), 1, 1, fill=False, hatch="//"))
    axes[0, 0].legend(
        handles, [*modes, "clips beyond rounding"], loc="lower center", bbox_to_anchor=(0.5, 1.12),
        ncol=len(modes) + 1, fontsize=7,
    )  # fmt: skip
    fig.supylabel("relative 2-norm error vs float64 (tick: bound)", fontsize=8)
    return save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- the run
def run(config: BlockScalingConfig, output: StudyOutput) -> int:
    """``mixprec study block-scaling``: measure, print the table and the recommendations, write
    ``block_scaling.csv`` (and ``block_scaling.png``)."""
    print(
        f"block-scaling: formats {config.formats}, modes {config.modes}, synthetic tensors {config.rows}x"
        f"{config.channels}, GPT width {config.model_width} after {config.model_steps} steps, seed {config.seed}",
        flush=True,
    )
    rows = run_study(config, progress=True)
    print("\nBlocks along the last dimension; errors against float64; error/bound <= 1 is the theory holding:\n")
    print(format_table(rows))
    print("\nTensors:")
    for kind, tensor in dict.fromkeys((r.kind, r.tensor) for r in rows):
        print(f"  {kind}: {tensor}")
    print("\nRecommendation (from the rows above: the lowest error among modes whose clipping changes no value):\n")
    print(format_recommendations(rows))
    written = [write_csv(rows, output.path("block_scaling.csv"))]
    if output.plot:
        written.append(plot_errors(rows, output.path("block_scaling.png")))
    print(wrote_lines(written))
    return 0
