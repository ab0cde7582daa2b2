"""``mixprec demo``'s uint8 section: is the uint8 run's offset from fp32 a property of the compression, or chaos?

Two measurements at simulated DP (the demo's model and batches, fp32 parameters):

* the mechanism, on one trajectory: along the fp32 run, every step's per-rank gradients are reduced twice, by the
  exact reduction and by the uint8 model (mixprec.lab.simulate, nearest rounding), and compared on the same
  gradients and optimizer state: cosine, norm ratio, the projection ``<u, g> / |g|^2`` (1: no change of step
  size along the true gradient), the shrinkage of magnitudes, and the same for the AdamW update each would give
  (after clipping);
* the outcome, against chaos: K fp32 replicas that differ in one ulp of the initial weights form the band; the
  uint8 run, and an fp32 run with the learning rate scaled by the measured update-norm ratio, are judged
  against it on training and validation loss.

docs/lab.md ("The uint8 offset") has the measured numbers and what they say.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.lab.band import Verdicts, band_verdicts, false_alarms, format_band_table, replica_configs
from mixprec.lab.build import build_parts
from mixprec.lab.compare import RunLog, load_run
from mixprec.lab.config import MAX_SEED, TrainConfig
from mixprec.lab.corpus import load_corpus
from mixprec.lab.pool import train_all
from mixprec.lab.simulate import SimulatedRanks

__all__ = [
    "UINT8_DEFAULT",
    "UINT8_FULL",
    "UINT8_QUICK",
    "ShadowStats",
    "measure_shadow",
    "plan_uint8_study",
    "run_uint8_study",
]

_DEMO_MODEL: dict[str, Any] = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "block_size": 64,
    "global_batch_size": 32,
    "micro_batch_size": 4,
    "eval_sequences": 64,
    "lr": 2e-3,
}
_TINY_MODEL: dict[str, Any] = {
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "block_size": 16,
    "global_batch_size": 16,
    "micro_batch_size": 2,
    "eval_sequences": 8,
    "lr": 0.01,
}
# shadow_steps: of the mechanism measurement; seeds: (fp32, uint8) pairs; error_feedback: also uint8 with error
# feedback per seed; replicas: an fp32 one-ulp band (0: none).
UINT8_DEFAULT: dict[str, Any] = {
    "model": _DEMO_MODEL,
    "dp": 4,
    "steps": 100,
    "eval_interval": 25,
    "shadow_steps": 40,
    "seeds": 4,
    "replicas": 0,
}
UINT8_QUICK: dict[str, Any] = {
    "model": _TINY_MODEL,
    "dp": 2,
    "steps": 8,
    "eval_interval": 4,
    "shadow_steps": 4,
    "seeds": 2,
    "replicas": 0,
    "workers": 1,
}
UINT8_FULL: dict[str, Any] = {
    "model": _DEMO_MODEL,
    "dp": 4,
    "steps": 200,
    "eval_interval": 25,
    "shadow_steps": 200,
    "seeds": 8,
    "replicas": 4,
    "error_feedback": True,
}
_WIDEN, _PERSIST = 1.0, 3


def _config(setting: dict[str, Any], seed: int, out_dir: str, **changes: Any) -> TrainConfig:
    return TrainConfig.from_fields(
        {
            **setting["model"],
            "precision": "fp32",
            "reduce": "native",
            "simulate_dp": setting["dp"],
            "steps": setting["steps"],
            "eval_interval": setting["eval_interval"],
            "checkpoint_interval": 0,
            "headroom_interval": 0,
            "device": "cpu",
            "seed": seed,
            "out_dir": out_dir,
            **changes,
        }
    )


@dataclass(frozen=True)
class ShadowStats:
    """Means over the steps of one trajectory: uint8-reduced gradient u against the exact one g, and the AdamW
    updates they give from the same state (after clipping each)."""

    steps: int
    grad_cosine: float
    grad_norm_ratio: float
    projection: float
    shrinkage: float
    update_cosine: float
    update_norm_ratio: float
    update_norm_ratio_sd: float
    projection_sd: float = 0.0


def _adamw_update(
    optimizer: torch.optim.Optimizer, grads: Sequence[torch.Tensor], state: Sequence[dict[str, torch.Tensor]]
) -> torch.Tensor:
    """The flattened AdamW update (torch's formula, weight decay aside) of ``grads`` from ``state``."""
    group = optimizer.param_groups[0]
    lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
    out = []
    for g, st in zip(grads, state, strict=True):
        t = float(st["step"]) + 1 if st else 1.0
        m = st["exp_avg"] * b1 + (1 - b1) * g if st else (1 - b1) * g
        v = st["exp_avg_sq"] * b2 + (1 - b2) * g * g if st else (1 - b2) * g * g
        denom = v.sqrt() / math.sqrt(1 - b2**t) + eps
        out.append((-lr / (1 - b1**t) * m / denom).reshape(-1))
    return torch.cat(out)


def _clipped(flat: torch.Tensor, max_norm: float) -> torch.Tensor:
    if not max_norm:
        return flat
    norm = flat.double().norm()
    return flat * min(1.0, max_norm / (float(norm) + 1e-6))  # torch.nn.utils.clip_grad_norm_'s coefficient


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def measure_shadow(cfg: TrainConfig) -> ShadowStats:
    """Train ``cfg`` (fp32, simulated DP, an exact reduction) and compare at every step its reduced gradient and
    AdamW update with those the uint8 reduction of the same per-rank gradients would give."""
    corpus = load_corpus(cfg.data.corpus)
    device = torch.device("cpu")
    parts = build_parts(cfg, corpus.vocab_size, device, 1)
    sim = SimulatedRanks(parts, cfg, corpus, device, shadow="uint8")
    optimizer = parts.optimizer
    params = list(parts.module.parameters())
    rows: list[tuple[float, ...]] = []
    for step in range(cfg.training.steps):
        state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()} for p in params]
        sim.step(step)
        g = torch.cat([t.reshape(-1) for t in sim.unpack(sim.reduced)]).double()
        u = torch.cat([t.reshape(-1) for t in sim.unpack(sim.shadow_reduced)]).double()
        clip = cfg.training.clip_grad_norm
        gc, uc = _clipped(g, clip), _clipped(u, clip)
        shapes = [p.shape for p in params]
        split = [n.numel() for n in params]
        upd_g = _adamw_update(optimizer, [t.view(s) for t, s in zip(gc.float().split(split), shapes)], state)
        upd_u = _adamw_update(optimizer, [t.view(s) for t, s in zip(uc.float().split(split), shapes)], state)
        gg = float(g @ g)
        rows.append(
            (
                _cos(u, g),
                float(u.norm() / g.norm()),
                float(u @ g) / gg,
                float((u.abs() - g.abs()).sum() / g.abs().sum()),
                _cos(upd_u, upd_g),
                float(upd_u.double().norm() / upd_g.double().norm()),
            )
        )
    cols = list(zip(*rows))
    return ShadowStats(
        len(rows),
        *[statistics.fmean(c) for c in cols],
        update_norm_ratio_sd=statistics.stdev(cols[5]) if len(rows) > 1 else 0.0,
        projection_sd=statistics.stdev(cols[2]) if len(rows) > 1 else 0.0,
    )


def _judge(replicas: list[RunLog], variants: list[RunLog], metric: str) -> tuple[str, list[Any]]:
    verdicts, spread = band_verdicts(replicas, variants, widen=_WIDEN, persist=_PERSIST, metric=metric)
    alarms = false_alarms(replicas, widen=_WIDEN, persist=_PERSIST, metric=metric)
    table = format_band_table(verdicts, spread, replicas=len(replicas), widen=_WIDEN, persist=_PERSIST, alarms=alarms)
    return table, verdicts


def _final_eval(run: RunLog) -> float:
    return run.eval_loss[max(run.eval_loss)]


def plan_uint8_study(out_dir: str, seed: int, setting: dict[str, Any]) -> list[TrainConfig]:
    """Every configuration the study trains (each checked): the shadow run, the seed pairs (with error feedback
    when the setting asks), the band's replicas."""
    last = seed + setting["seeds"] - 1
    if last > MAX_SEED:
        raise ValueError(
            f"seed must be at most {MAX_SEED - setting['seeds'] + 1}: the uint8 study trains seeds {seed} to {last}, "
            f"and torch takes seeds up to {MAX_SEED}"
        )
    where = os.path.join(out_dir, "uint8-offset")
    configs = [_config(setting, seed, os.path.join(where, "shadow"), steps=setting["shadow_steps"])]
    for s in range(seed, seed + setting["seeds"]):
        configs.append(_config(setting, s, os.path.join(where, f"seed-{s}", "fp32")))
        configs.append(_config(setting, s, os.path.join(where, f"seed-{s}", "uint8"), reduce="uint8"))
        if setting.get("error_feedback"):
            ef = os.path.join(where, f"seed-{s}", "uint8-ef")
            configs.append(_config(setting, s, ef, reduce="uint8", error_feedback=True))
    if setting.get("replicas"):
        configs += replica_configs(_config(setting, seed, os.path.join(where, "band-fp32")), setting["replicas"])
    return configs


@dataclass(frozen=True)
class _Runs:
    """The study's trained runs: per seed an (fp32, uint8) pair, uint8 with error feedback per seed (when the
    setting asks), and the fp32 one-ulp band (when it asks for replicas)."""

    seeds: list[int]
    pairs: list[tuple[TrainConfig, TrainConfig]]
    error_feedback: list[TrainConfig]
    band: list[TrainConfig]


def _train_runs(out_dir: str, seed: int, setting: dict[str, Any], workers: int | None) -> _Runs:
    where = os.path.join(out_dir, "uint8-offset")
    seeds = [seed + k for k in range(setting["seeds"])]
    pairs = [
        (
            _config(setting, s, os.path.join(where, f"seed-{s}", "fp32")),
            _config(setting, s, os.path.join(where, f"seed-{s}", "uint8"), reduce="uint8"),
        )
        for s in seeds
    ]
    ef_runs = [
        _config(setting, s, os.path.join(where, f"seed-{s}", "uint8-ef"), reduce="uint8", error_feedback=True)
        for s in (seeds if setting.get("error_feedback") else [])
    ]
    band = []
    if setting.get("replicas"):
        band = replica_configs(_config(setting, seed, os.path.join(where, "band-fp32")), setting["replicas"])
    workers = workers if workers is not None else setting.get("workers")
    failures = train_all([c for pair in pairs for c in pair] + ef_runs + band, workers=workers, label="uint8 offset:")
    if any(failures):
        raise RuntimeError(f"internal error: a uint8-offset run failed: {failures}")
    return _Runs(seeds, pairs, ef_runs, band)


def _mechanism(stats: ShadowStats, setting: dict[str, Any]) -> tuple[list[str], str, bool, bool]:
    """The report's opening paragraph, the mechanism's verdict line, and whether the update norm changed
    (a change of step size) and the projection moved (a bias along the gradient): each off 1 by more than 1% and
    by more than 3 standard errors."""
    m = setting["model"]
    lines = [
        "## The uint8 offset: compression or chaos?",
        "",
        f"A GPT of {m['n_layer']} layer(s), width {m['n_embd']}, global batch {m['global_batch_size']}, lr "
        f"{m['lr']:g}, fp32 parameters, at simulated DP {setting['dp']} (bit for bit the `--nproc "
        f"{setting['dp']}` runs), {setting['steps']} steps.",
        "",
        f"**Mechanism**, measured along the fp32 run ({stats.steps} steps; every step's per-rank gradients and "
        "optimizer state reduced both ways): the uint8-reduced gradient u against g, the run's own fp32 reduction, has "
        "cosine "
        f"{stats.grad_cosine:.5f}, norm ratio |u|/|g| = {stats.grad_norm_ratio:.5f}, projection <u,g>/|g|^2 = "
        f"{stats.projection:.5f} (1 = no change of step size along g; a bias would move it), summed magnitudes "
        f"{stats.shrinkage:+.3%} against g's; the AdamW updates they give from the same state have cosine "
        f"{stats.update_cosine:.5f} and norm ratio {stats.update_norm_ratio:.5f} (standard deviation over the steps "
        f"{stats.update_norm_ratio_sd:.5f}).",
    ]
    step_change = _off_one(stats.update_norm_ratio, stats.update_norm_ratio_sd, stats.steps)
    bias = _off_one(stats.projection, stats.projection_sd, stats.steps)
    found = (["an effective change of step size (update-norm ratio)"] if step_change else []) + (
        ["a bias along the gradient (projection)"] if bias else []
    )
    summary = (
        f"mechanism: projection <u,g>/|g|^2 = {stats.projection:.4f}, AdamW update-norm ratio "
        f"{stats.update_norm_ratio:.4f}, update cosine {stats.update_cosine:.4f}: "
        + (
            "; ".join(found)
            if found
            else "neither a significant bias along the gradient (projection) nor a significant change of step size "
            "(update-norm ratio): each within 1% of 1, or within 3 standard errors; what remains is noise, about "
            f"{math.sqrt(max(0.0, 2 * (1 - stats.grad_cosine))):.1%} of the gradient's norm per step"
        )
    )
    return lines, summary, step_change, bias


def _mean_se(diffs: list[float]) -> tuple[float, float]:
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return statistics.fmean(diffs), se


def _outcome(runs: _Runs) -> tuple[list[str], list[str], list[float]]:
    """The table of final validation losses per seed, its verdict lines, and the uint8 - fp32 differences."""
    with_ef = bool(runs.error_feedback)
    lines = [
        "",
        f"**Outcome over {len(runs.seeds)} data seeds** (each seed: its own initial weights and batches; uint8 and "
        "fp32 from the same start): final validation loss.",
        "",
        "| seed | fp32 | uint8 | uint8 - fp32 |" + (" uint8 + error feedback - fp32 |" if with_ef else ""),
        "|---|---|---|---|" + ("---|" if with_ef else ""),
    ]
    diffs, ef_diffs = [], []
    for k, (s, (f, u)) in enumerate(zip(runs.seeds, runs.pairs, strict=True)):
        ef, eu = _final_eval(load_run(f.training.out_dir)), _final_eval(load_run(u.training.out_dir))
        diffs.append(eu - ef)
        row = f"| {s} | {ef:.4f} | {eu:.4f} | {eu - ef:+.4f} |"
        if with_ef:
            ef_diffs.append(_final_eval(load_run(runs.error_feedback[k].training.out_dir)) - ef)
            row += f" {ef_diffs[-1]:+.4f} |"
        lines.append(row)
    mean, se = _mean_se(diffs)
    below = sum(d < 0 for d in diffs)
    systematic = abs(mean) > 3 * se and (all(d < 0 for d in diffs) or all(d > 0 for d in diffs))
    lines += ["", f"Mean difference {mean:+.4f}, standard error {se:.4f} over {len(diffs)} seeds; {below} of "
              f"{len(diffs)} below fp32."]  # fmt: skip
    summary = []
    if ef_diffs:
        ef_mean, ef_se = _mean_se(ef_diffs)
        lines.append(f"With error feedback: mean difference {ef_mean:+.4f}, standard error {ef_se:.4f}.")
        summary.append(
            f"uint8 with error feedback - fp32 final validation loss {ef_mean:+.4f} +- {ef_se:.4f} (standard error, "
            f"{len(ef_diffs)} seeds)"
        )
    summary.append(
        f"outcome: uint8 - fp32 final validation loss {mean:+.4f} +- {se:.4f} (standard error, {len(diffs)} seeds; "
        f"{below} of {len(diffs)} below): "
        + ("systematic (more than 3 standard errors, one sign)" if systematic else "not systematic")
    )
    return lines, summary, diffs


def _band_section(seed: int, runs: _Runs) -> tuple[list[str], list[str]]:
    """The first seed's uint8 run against the fp32 one-ulp band, on training and validation loss."""
    lines: list[str] = []
    summary: list[str] = []
    replicas = [load_run(c.training.out_dir, f"replica-{k}") for k, c in enumerate(runs.band)]
    u8 = [load_run(runs.pairs[0][1].training.out_dir, "uint8")]
    for metric, what in (("loss", "training loss"), ("eval_loss", "validation loss")):
        table, verdicts = _judge(replicas, u8, metric)
        lines += ["", f"Seed {seed}'s uint8 run against a band of fp32 replicas one ulp apart, {what}:", "", table]
        for v in verdicts:
            out = "stays inside" if v.leaves_at is None else f"leaves it ({v.side}) at step {v.leaves_at}"
            summary.append(f"uint8 {out} the one-ulp fp32 band on the {what} (final z = {v.z_final:+.1f})")
    return lines, summary


def run_uint8_study(
    out_dir: str, seed: int, setting: dict[str, Any], *, workers: int | None = None
) -> tuple[str, Verdicts]:
    """The shadow measurement, the seed pairs (and with ``replicas`` the ulp band); returns the report section
    and the verdict lines (``headline``: the offset's verdict with the numbers it rests on)."""
    plan_uint8_study(out_dir, seed, setting)
    print("mixprec demo: uint8 offset: the uint8 reduction beside the fp32 one, step by step", flush=True)
    where = os.path.join(out_dir, "uint8-offset")
    stats = measure_shadow(_config(setting, seed, os.path.join(where, "shadow"), steps=setting["shadow_steps"]))
    runs = _train_runs(out_dir, seed, setting, workers)
    lines, mechanism, step_change, bias = _mechanism(stats, setting)
    outcome_lines, summary, diffs = _outcome(runs)
    lines += outcome_lines
    summary.insert(0, mechanism)
    if runs.band:
        band_lines, band_summary = _band_section(seed, runs)
        lines += band_lines
        summary += band_summary
    verdict = offset_verdict(diffs, step_change=step_change, bias=bias)
    summary.append("verdict: " + verdict)
    lines += ["", "Verdicts:", "", *[f"- {s}" for s in summary]]
    mean, se = _mean_se(diffs)
    headline = (
        f"uint8 - fp32 final validation loss {mean:+.4f} +- {se:.4f} over {len(diffs)} seeds at DP {setting['dp']}: "
        + verdict
    )
    return "\n".join(lines) + "\n", Verdicts(summary, headline)


def _off_one(mean: float, sd: float, steps: int) -> bool:
    """``mean`` differs from 1 by more than 1% and by more than 3 standard errors."""
    off = abs(mean - 1)
    return off > 0.01 and off > 3 * sd / math.sqrt(steps)


def offset_verdict(diffs: list[float], *, step_change: bool, bias: bool) -> str:
    """The verdict on the uint8 - fp32 final-loss differences over the seeds, worded by what was tested."""
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    same_sign = all(d < 0 for d in diffs) or all(d > 0 for d in diffs)
    mechanism = "a measured " + " and ".join(
        (["change of step size"] if step_change else []) + (["bias along the gradient"] if bias else [])
    )
    if abs(mean) > 3 * se and same_sign:
        if step_change or bias:
            return f"a property of the compression: a systematic offset with {mechanism}"
        return (
            "a property of the compression: a systematic offset, though neither a bias along the gradient nor a "
            "change of step size was measured; its noise is the candidate"
        )
    if same_sign:
        head = (
            f"not distinguishable from the seed-to-seed spread with {len(diffs)} seed(s): the offsets share a sign "
            "but their mean is within 3 standard errors"
        )
    else:
        head = "chaos: the sign and size of the uint8 run's offset change with the seed"
    if step_change or bias:
        return head + f", though the reduction shows {mechanism}"
    return (
        head + ", and the reduction shows neither a bias along the gradient nor a change of step size; no evidence "
        "that the offset is an effect of the compression"
    )
