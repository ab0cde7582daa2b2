"""``mixprec demo``'s loss-scale section: the rules of ``mixprec check-config``, measured at simulated DP.

fp16 parameters and gradients, a static loss scale, global and micro batch fixed, so the number of microbatches
is n = GBS / (MBS x DP) and each microbatch's gradient is multiplied by loss_scale / n before it is rounded to
fp16. Against a band of correctly scaled replicas (factor F at both sizes), three broken configurations: a scale
of 1 at the small DP (below n: the scale of 1 that was right at the large DP, not rescaled when DP shrank), a
factor 2**-12 (what a scale of 1 gives with 4096 microbatches), and the small DP's scale kept at the large DP
(not rescaled when DP grew: factor F x DP ratio). Each is measured twice: on the same weights and batch, the
fraction of gradient elements that are nonzero in fp32 and flush to zero in fp16 (per rank, and after the
reduction), and as a loss curve against the band. docs/lab.md ("The loss-scale rules, measured") has the numbers.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.lab.band import BandVerdict, Verdicts, band_verdicts, false_alarms, format_band_table, replica_configs
from mixprec.lab.build import build_model
from mixprec.lab.checkpoint import CHECKPOINT_NAME, load_train_checkpoint
from mixprec.lab.compare import load_run
from mixprec.lab.config import TrainConfig
from mixprec.lab.corpus import Corpus, load_corpus
from mixprec.lab.data import train_microbatches
from mixprec.lab.dp_band import STUDY_BASE
from mixprec.lab.metrics import METRICS_NAME, read_rows
from mixprec.lab.pool import train_all

__all__ = [
    "SCALE_DEFAULT",
    "SCALE_FULL",
    "SCALE_QUICK",
    "Flush",
    "measure_flush",
    "plan_scale_study",
    "run_scale_study",
]

# The DP-band study's small GPT and run settings: the demo's studies train one model.
_BASE: dict[str, Any] = {
    **STUDY_BASE,
    "precision": "fp16",
    "reduce": "fp32_accumulate",
    "kind": "static",
    "max_consecutive_skips": 0,  # a scale that overflows every step: the curve shows it, to the end
    "headroom_interval": 0,
}
# sizes: (small DP, large DP); factor: the correct loss_scale / num_microbatches.
SCALE_DEFAULT: dict[str, Any] = {"sizes": (4, 64), "global_batch_size": 64, "steps": 30, "replicas": 4}
SCALE_QUICK: dict[str, Any] = {"sizes": (2, 16), "global_batch_size": 16, "steps": 6, "replicas": 2, "workers": 1}
SCALE_FULL: dict[str, Any] = {"sizes": (4, 256), "global_batch_size": 256, "steps": 60, "replicas": 8}
_FACTOR = 2.0**12
_FAR = 2.0**-12
_WIDEN, _PERSIST = 1.0, 3


def _pow2(x: float) -> str:
    """``2^k`` for a power of two, else the number."""
    mantissa, exponent = math.frexp(x)
    return f"2^{exponent - 1}" if mantissa == 0.5 else f"{x:g}"


@dataclass(frozen=True)
class _Variant:
    role: str
    size: int
    scale: float
    description: str


def _variants(setting: dict[str, Any]) -> list[_Variant]:
    small, large = setting["sizes"]
    gbs = setting["global_batch_size"]
    n_small, n_large = gbs // small, gbs // large
    return [
        _Variant("band-small", small, n_small * _FACTOR, f"correct at DP {small}: scale {n_small} x {_pow2(_FACTOR)}"),
        _Variant("band-large", large, n_large * _FACTOR, f"correct at DP {large}: scale {n_large} x {_pow2(_FACTOR)}"),
        _Variant(
            "below-microbatches",
            small,
            float(n_large),
            f"scale {n_large:g} < {n_small} microbatches at DP {small} (right at DP {large}, not rescaled when DP "
            "shrank)",
        ),
        _Variant(
            "far-below",
            small,
            n_small * _FAR,
            f"scale {n_small} x {_pow2(_FAR)} at DP {small} (as scale 1 with 4096 microbatches)",
        ),
        _Variant(
            "not-rescaled-up",
            large,
            n_small * _FACTOR,
            f"scale {n_small} x {_pow2(_FACTOR)} of DP {small} kept at DP {large} (not rescaled when DP grew)",
        ),
    ]


def plan_scale_study(out_dir: str, seed: int, setting: dict[str, Any]) -> list[tuple[_Variant, TrainConfig]]:
    """(variant, configuration) of every run; the band variants once per replica."""
    plan = []
    for v in _variants(setting):
        cfg = TrainConfig.from_fields(
            {
                **_BASE,
                "global_batch_size": setting["global_batch_size"],
                "steps": setting["steps"],
                "seed": seed,
                "simulate_dp": v.size,
                "init_scale": v.scale,
                "out_dir": os.path.join(out_dir, "loss-scale", v.role),
            }
        )
        if v.role.startswith("band"):
            plan += [(v, c) for c in replica_configs(cfg, setting["replicas"])]
        else:
            plan.append((v, cfg))
    return plan


@dataclass(frozen=True)
class Flush:
    """Gradient elements nonzero in the fp32 gradient that are zero in the fp16 one (fractions of those nonzero
    in fp32): per rank after its microbatches (mean over ranks), and after the fp32-accumulate reduction; the
    flushed elements' share of the reduced gradient's squared norm; elements that overflowed to inf/NaN."""

    rank: float
    reduced: float
    norm_share: float
    overflow: float


@torch.no_grad()
def _zero_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def measure_flush(cfg: TrainConfig, corpus: Corpus, *, step: int, weights: dict[str, Any] | None = None) -> Flush:
    """:class:`Flush` of ``cfg``'s fp16 gradients at ``step``'s batch, on its initial weights or ``weights``.

    Each simulated rank's microbatches run through the fp16 model as the Updater runs them (loss / n times the
    scale, gradients rounded to fp16 and accumulated in fp16) and through an exact fp32 copy (loss / n, no
    scale); the reduction is mixprec's fp32-accumulate (fp32 sum in rank order, divide, one rounding)."""
    m16 = build_model(cfg, corpus.vocab_size, torch.device("cpu"))
    if weights is not None:
        m16.load_state_dict(weights)
    m32 = copy.deepcopy(m16).float()
    world, n = cfg.parallel.ranks, cfg.num_microbatches
    scaler = cfg.build_scaler()
    flushed = nonzero = 0
    acc16 = acc32 = None
    for rank in range(world):
        _zero_grads(m16)
        _zero_grads(m32)
        for x, y in train_microbatches(
            corpus.train,
            seed=cfg.training.seed,
            step=step,
            global_batch_size=cfg.data.global_batch_size,
            micro_batch_size=cfg.data.micro_batch_size,
            block_size=cfg.model.block_size,
            rank=rank,
            world_size=world,
        ):
            with torch.enable_grad():
                scaler.scale(m16(x, y)[1].float() / n).backward()
                (m32(x, y)[1] / n).backward()
        g16 = torch.cat([p.grad.reshape(-1) for p in m16.parameters()])
        g32 = torch.cat([p.grad.reshape(-1) for p in m32.parameters()])
        flushed += int(((g16 == 0) & (g32 != 0)).sum())
        nonzero += int((g32 != 0).sum())
        acc16 = g16.float() if acc16 is None else acc16.add_(g16.float())
        acc32 = g32.clone() if acc32 is None else acc32.add_(g32)
    if acc16 is None or acc32 is None:
        raise RuntimeError("internal error: no simulated rank")
    red16, ref = (acc16 / world).half(), acc32 / world
    lost = (red16 == 0) & (ref != 0)
    return Flush(
        rank=flushed / max(nonzero, 1),
        reduced=int(lost.sum()) / max(int((ref != 0).sum()), 1),
        norm_share=float(ref[lost].double().square().sum() / ref.double().square().sum().clamp_min(1e-300)),
        overflow=float((~torch.isfinite(red16)).float().mean()),
    )


def _skipped(path: str) -> int:
    return sum(bool(row.get("skipped")) for row in read_rows(os.path.join(path, METRICS_NAME)))


def _headline(judged: Sequence[tuple[BandVerdict, Flush, Flush, int]], steps: int) -> str:
    """The broken configurations' verdicts in one sentence: which left the band of correctly scaled runs, what
    each flushed beside the correct scale at its DP, and the rule that follows."""
    left = [f"{v.name} ({v.side} from step {v.leaves_at})" for v, _, _, _ in judged if v.leaves_at is not None]
    if left:
        curve = f"{len(left)} of {len(judged)} misscaled configurations left the band of correctly scaled runs: "
        curve += ", ".join(left)
    else:
        curve = f"none of {len(judged)} misscaled configurations left the band of correctly scaled runs at this size"
    flushed = ", ".join(
        f"{v.name} {f.reduced:.2%} (correct scale {ref.reduced:.2%}; {f.overflow:.1%} overflow, {skipped} of "
        f"{steps} steps skipped)"
        for v, f, ref, skipped in judged
    )
    return (
        f"{curve}; gradient elements flushed to zero after the reduction, at init: {flushed}. Keep loss_scale / "
        "microbatches fixed (a power of two) when DP or the number of microbatches changes; `mixprec check-config` "
        "flags a scale that does not"
    )


def _intro(setting: dict[str, Any]) -> list[str]:
    small, large = setting["sizes"]
    gbs, steps = setting["global_batch_size"], setting["steps"]
    return [
        "## Loss scale against microbatches and data parallelism",
        "",
        f"fp16 parameters and gradients, static loss scale, fp32-accumulate reduction; a GPT of {_BASE['n_layer']} "
        f"layer, width {_BASE['n_embd']}, global batch {gbs} sequences of {_BASE['block_size']}, micro batch "
        f"{_BASE['micro_batch_size']}, {steps} steps at simulated DP {small} ({gbs // small} microbatches per rank) "
        f"and DP {large} ({gbs // large}). Each microbatch's gradient is multiplied by loss_scale / microbatches "
        "before it is rounded to fp16 (the rule `mixprec check-config` checks). Flushed: gradient elements nonzero "
        "in fp32 that are zero in fp16, measured on the same weights and batch (the initial ones, and those "
        f"after {steps} steps of the correct DP-{small} run): per rank, after the reduction, and the flushed "
        "elements' share of the reduced gradient's squared norm.",
        "",
        "| configuration | check-config | flushed per rank (init / end) | flushed after reduction (init / end) "
        "| share of norm^2 (end) | overflow | skipped steps |",
        "|---|---|---|---|---|---|---|",
    ]


def _flush_rows(
    by_role: dict[str, list[TrainConfig]], variants: dict[str, _Variant], setting: dict[str, Any]
) -> tuple[list[str], dict[str, Flush]]:
    """One table line per configuration: check-config's findings and the flush fractions at init (and, at the
    small DP, on the correct run's final weights); returns them and each role's flush at init."""
    first = next(iter(by_role.values()))[0]
    corpus = load_corpus(first.data.corpus)
    final = load_train_checkpoint(os.path.join(first.training.out_dir, CHECKPOINT_NAME))["model"]
    small, steps = setting["sizes"][0], setting["steps"]
    lines, at_init = [], {}
    for role, cfgs in by_role.items():
        cfg = cfgs[0]
        end = measure_flush(cfg, corpus, step=steps, weights=final) if cfg.parallel.ranks == small else None
        init = measure_flush(cfg, corpus, step=0)
        at_init[role] = init
        advice = cfg.advice()
        codes = ", ".join(f.code for f in advice.findings if f.severity != "info") or "ok"
        end_rank = f"{end.rank:.3%}" if end else "-"
        end_red = f"{end.reduced:.3%}" if end else "-"
        share = f"{end.norm_share:.1e}" if end else f"{init.norm_share:.1e} (init)"
        lines.append(
            f"| {variants[role].description} (factor {_pow2(advice.effective_scale)}) | {codes} | {init.rank:.3%} / "
            f"{end_rank} | {init.reduced:.3%} / {end_red} | {share} | {init.overflow:.2%} | "
            f"{_skipped(cfg.training.out_dir)} of {steps} |"
        )
    return lines, at_init


def _band_sections(
    by_role: dict[str, list[TrainConfig]],
    variants: dict[str, _Variant],
    flush: dict[str, Flush],
    setting: dict[str, Any],
) -> tuple[list[str], list[str], list[tuple[BandVerdict, Flush, Flush, int]]]:
    """Each broken configuration's training loss against the band of correctly scaled replicas at its DP: the
    tables, one verdict line each, and what the headline needs."""
    steps = setting["steps"]
    lines: list[str] = []
    summary: list[str] = []
    judged: list[tuple[BandVerdict, Flush, Flush, int]] = []
    for band_role, size in zip(("band-small", "band-large"), setting["sizes"], strict=True):
        replicas = [load_run(c.training.out_dir, f"replica-{k}") for k, c in enumerate(by_role[band_role])]
        others = [r for r in by_role if not r.startswith("band") and variants[r].size == size]
        runs = [load_run(by_role[r][0].training.out_dir, r) for r in others]
        verdicts, spread = band_verdicts(replicas, runs, widen=_WIDEN, persist=_PERSIST)
        alarms = false_alarms(replicas, widen=_WIDEN, persist=_PERSIST)
        lines += [
            "",
            f"Training loss against the band of the correctly scaled run at DP {size}:",
            "",
            format_band_table(verdicts, spread, replicas=len(replicas), widen=_WIDEN, persist=_PERSIST, alarms=alarms),
        ]
        ref = flush[band_role]
        for v in verdicts:
            f0, skipped = flush[v.name], _skipped(by_role[v.name][0].training.out_dir)
            judged.append((v, f0, ref, skipped))
            where = "stays inside" if v.leaves_at is None else f"leaves it ({v.side}) at step {v.leaves_at}"
            effect = (
                "no effect on the curve visible at this size"
                if v.leaves_at is None
                else f"{v.outside:.0%} of steps outside, final loss {v.final:.4f} (z = {v.z_final:+.1f})"
            )
            summary.append(
                f"{variants[v.name].description}: flushes {f0.reduced:.3%} of the reduced gradient's nonzero "
                f"elements at init (correct scale: {ref.reduced:.3%}), {f0.overflow:.1%} overflow, "
                f"{skipped} of {steps} steps skipped; against the band of "
                f"{len(replicas)} correctly scaled replicas at DP {size} it {where}: {effect}"
            )
    return lines, summary, judged


def run_scale_study(
    out_dir: str, seed: int, setting: dict[str, Any], *, workers: int | None = None
) -> tuple[str, Verdicts]:
    """Train every run of :func:`plan_scale_study`, measure the flush fractions; returns the report section
    (markdown) and one verdict line per broken configuration (``headline``: all of them in one sentence)."""
    plan = plan_scale_study(out_dir, seed, setting)
    workers = workers if workers is not None else setting.get("workers")
    failures = train_all([cfg for _, cfg in plan], workers=workers, label="loss scale:")
    for (_, cfg), failure in zip(plan, failures, strict=True):
        if failure is not None:
            raise RuntimeError(f"internal error: the loss-scale run {cfg.training.out_dir} failed: {failure}")
    by_role: dict[str, list[TrainConfig]] = {}
    for v, cfg in plan:
        by_role.setdefault(v.role, []).append(cfg)
    variants = {v.role: v for v, _ in plan}
    rows, flush = _flush_rows(by_role, variants, setting)
    bands, summary, judged = _band_sections(by_role, variants, flush, setting)
    lines = [*_intro(setting), *rows, *bands, "", "Verdicts:", "", *[f"- {s}" for s in summary]]
    return "\n".join(lines) + "\n", Verdicts(summary, _headline(judged, setting["steps"]))
