"""Noise bands: the spread that chaos alone gives a loss curve, and whether a variant leaves it.

K replicas of one configuration differ only in the last bit of their initial weights (``training.perturb =
k`` moves every weight one ulp up or down by a sign pattern seeded by k; replica 0 is unperturbed), so any
difference between their curves is the trajectory's sensitivity, not an effect of precision. At each step
the band is the replicas' [min, max] widened on both sides by ``widen`` times its width (the range of K
samples underestimates the spread; ``widen = 1`` triples the width). A variant leaves the band at the first
step from which it lies outside for ``persist`` consecutive logged steps; the table also gives the fraction
of steps outside and the final value's z-score against the replicas' mean and standard deviation.
``training.seed`` replicas (different data and initial weights) give the mean and spread of the final loss
instead. docs/lab.md ("Noise bands") has the commands and the reasoning.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mixprec.lab.compare import RunLog
from mixprec.lab.config import TrainConfig

__all__ = [
    "REPLICA_PREFIX",
    "BandVerdict",
    "Verdicts",
    "band_runs",
    "band_verdicts",
    "false_alarms",
    "format_band_table",
    "perturb_weights",
    "replica_configs",
]

REPLICA_PREFIX = "replica-"


@torch.no_grad()
def perturb_weights(module: torch.nn.Module, k: int) -> None:
    """Move every floating-point parameter of ``module`` one ulp (of its own dtype) up or down, in place; the
    signs come from a generator seeded by ``k`` and are drawn in parameter order."""
    gen = torch.Generator().manual_seed(k)
    for p in module.parameters():
        if not p.is_floating_point():
            continue
        up = torch.randint(0, 2, p.shape, generator=gen).to(p.device, torch.bool)
        inf = torch.tensor(math.inf, dtype=p.dtype, device=p.device)
        p.copy_(torch.nextafter(p, torch.where(up, inf, -inf)))


def replica_configs(cfg: TrainConfig, replicas: int, kind: str = "ulp") -> list[TrainConfig]:
    """``replicas`` copies of ``cfg`` in ``out_dir/replica-k``: kind 'ulp' sets ``training.perturb = k``, 'seed'
    sets ``training.seed`` to the seed + k. Replica 0 is ``cfg`` itself (moved to its subdirectory)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 2:
        raise ValueError(f"--replicas must be an integer >= 2 (a band needs a spread); got {replicas!r}")
    if kind not in ("ulp", "seed"):
        raise ValueError(f"replica kind must be 'ulp' or 'seed'; got {kind!r}")
    t = cfg.training
    out = []
    for k in range(replicas):
        change = {"perturb": k} if kind == "ulp" else {"seed": t.seed + k}
        out.append(cfg.replace(training={**change, "out_dir": os.path.join(t.out_dir, f"{REPLICA_PREFIX}{k}")}))
    return out


def band_runs(band_dir: str) -> list[str]:
    """The replica run directories under ``band_dir`` (what ``mixprec train --replicas`` wrote), in order."""
    if not os.path.isdir(band_dir):
        raise ValueError(f"--band {band_dir!r} is not a directory")
    names = [n for n in os.listdir(band_dir) if n.startswith(REPLICA_PREFIX) and n[len(REPLICA_PREFIX) :].isdigit()]
    if len(names) < 2:
        raise ValueError(f"--band {band_dir!r} holds {len(names)} replica-K run(s); a band needs at least 2")
    return [os.path.join(band_dir, n) for n in sorted(names, key=lambda n: int(n[len(REPLICA_PREFIX) :]))]


class Verdicts(list[str]):
    """A study's verdict lines, with ``headline``: the one sentence of the study a user acts on (what was
    measured, the verdict, and what to do), which ``mixprec demo``'s report opens with."""

    def __init__(self, lines: Iterable[str] = (), headline: str = "") -> None:
        super().__init__(lines)
        self.headline = headline


@dataclass(frozen=True)
class BandVerdict:
    """One variant against the band.

    Attributes:
        leaves_at: first step of the first run of ``persist`` consecutive steps outside the band; None if none.
        side: 'above' or 'below' the band at ``leaves_at`` (None when it stays inside).
        outside: fraction of the common steps at which the variant lies outside the band.
        final: the variant's value at the last common step; z_final its z-score against the replicas there.
    """

    name: str
    leaves_at: int | None
    side: str | None
    outside: float
    final: float
    z_final: float


def _values(run: RunLog, metric: str) -> dict[int, float]:
    return run.loss if metric == "loss" else run.eval_loss


def band_verdicts(
    replicas: Sequence[RunLog],
    variants: Sequence[RunLog],
    *,
    widen: float = 1.0,
    persist: int = 3,
    metric: str = "loss",
) -> tuple[list[BandVerdict], tuple[float, float]]:
    """Each variant's verdict, and the replicas' (mean, standard deviation) at the last common step."""
    if len(replicas) < 2:
        raise ValueError(f"a band needs at least 2 replica runs; got {len(replicas)}")
    if not widen >= 0 or persist < 1:
        raise ValueError(f"widen must be >= 0 and persist >= 1; got {widen!r}, {persist!r}")
    verdicts, spread = _judge(replicas, variants, widen, persist, metric)
    return verdicts, spread


def false_alarms(replicas: Sequence[RunLog], *, widen: float = 1.0, persist: int = 3, metric: str = "loss") -> int:
    """Leave-one-out calibration of the statistic: how many replicas leave the band of the others (each is an
    exchangeable copy, so every one that does is a false alarm). Needs at least 3 replicas."""
    if len(replicas) < 3:
        return 0
    count = 0
    for i, run in enumerate(replicas):
        others = [r for j, r in enumerate(replicas) if j != i]
        (verdict,), _ = _judge(others, [run], widen, persist, metric)
        count += verdict.leaves_at is not None
    return count


def _check_replicas(replicas: Sequence[RunLog], metric: str) -> None:
    """Replicas that logged different steps (one stopped early, or ran longer) give no band over the steps they
    do not share: refuse them, naming the replica that differs from the first, instead of cutting the band to
    the shorter one."""
    first = _values(replicas[0], metric)
    for run in replicas[1:]:
        values = _values(run, metric)
        if values.keys() != first.keys():
            raise ValueError(
                f"replica {run.path} logged {metric} at {_span(values)}, but replica {replicas[0].path} at "
                f"{_span(first)}: every replica of a band must log the same steps (finish the shorter one with "
                "mixprec train --resume --training.steps N, or leave it out of the band directory)"
            )


def _span(values: dict[int, float]) -> str:
    steps = sorted(values)
    return f"{len(steps)} steps ({steps[0]}..{steps[-1]})" if steps else "no step"


def _judge(
    replicas: Sequence[RunLog], variants: Sequence[RunLog], widen: float, persist: int, metric: str
) -> tuple[list[BandVerdict], tuple[float, float]]:
    _check_replicas(replicas, metric)
    series = [_values(r, metric) for r in replicas]
    steps = sorted(set.intersection(*(set(s) for s in series)))
    if not steps:
        raise ValueError(f"the replica runs share no step with a {metric} value")
    band: dict[int, tuple[float, float]] = {}
    for step in steps:
        values = [s[step] for s in series]
        lo, hi = min(values), max(values)
        band[step] = (lo - widen * (hi - lo), hi + widen * (hi - lo))
    last = [s[steps[-1]] for s in series]
    mean, sd = statistics.fmean(last), statistics.stdev(last)
    verdicts = []
    for run in variants:
        values = _values(run, metric)
        common = [s for s in steps if s in values]
        if not common:
            raise ValueError(f"{run.path}: no step in common with the band's runs")
        outside = [not band[s][0] <= values[s] <= band[s][1] for s in common]
        leaves_at = side = None
        for i in range(len(common) - persist + 1):
            if all(outside[i : i + persist]):
                leaves_at = common[i]
                side = "above" if values[leaves_at] > band[leaves_at][1] else "below"
                break
        final = values[common[-1]]
        z = (final - mean) / sd if sd > 0 else (0.0 if final == mean else math.copysign(math.inf, final - mean))
        verdicts.append(BandVerdict(run.name, leaves_at, side, sum(outside) / len(outside), final, z))
    return verdicts, (mean, sd)


def format_band_table(
    verdicts: Sequence[BandVerdict],
    spread: tuple[float, float],
    *,
    replicas: int,
    widen: float,
    persist: int,
    alarms: int | None = None,
) -> str:
    """A markdown table of the verdicts, preceded by the statistic used."""
    mean, sd = spread
    lines = [
        f"band: {replicas} replicas; per step [min - {widen:g} w, max + {widen:g} w] with w = max - min; a variant "
        f"leaves it at the first of {persist} consecutive steps outside. Replicas' final value: {mean:.4f} "
        f"+- {sd:.4f} (mean +- standard deviation).",
    ]
    if alarms is not None and replicas >= 3:
        lines.append(
            f"calibration: {alarms} of {replicas} replicas leave the band of the other {replicas - 1} (false alarms)."
        )
    lines += [
        "",
        "| run | verdict | steps outside | final | z (final) |",
        "|---|---|---|---|---|",
    ]
    for v in verdicts:
        verdict = "inside" if v.leaves_at is None else f"leaves {v.side} at step {v.leaves_at}"
        lines.append(f"| {v.name} | {verdict} | {v.outside:.0%} | {v.final:.4f} | {v.z_final:+.2f} |")
    return "\n".join(lines)
