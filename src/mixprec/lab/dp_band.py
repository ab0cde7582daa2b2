"""``mixprec demo --dp-band``: reduction precision at simulated data-parallel sizes, judged against a noise band.

At each simulated size P (4 and 1024; 4 and 16 with ``--quick``) the same small GPT and global batch are
trained as K fp32 replicas that differ only in the last bit of their initial weights (the band: what chaos
alone does), and as two bf16 variants: the backend's native reduction (gloo's ring, rounding to bf16 at every
one of the P-1 hops) and the fp32-accumulate reduction (one rounding). The report section says, per size and
variant, whether and from which step the variant leaves the fp32 band, with the statistic stated
(mixprec.lab.band). The global batch is the same at every P, so only the reduction changes with P.
"""

from __future__ import annotations

import os
from typing import Any

from mixprec.lab.band import BandVerdict, Verdicts, band_verdicts, false_alarms, format_band_table, replica_configs
from mixprec.lab.compare import RunLog, load_run
from mixprec.lab.config import TrainConfig
from mixprec.lab.pool import train_all

__all__ = ["DP_BAND_DEFAULT", "DP_BAND_FULL", "DP_BAND_QUICK", "plan_dp_band", "run_dp_band"]

STUDY_BASE: dict[str, Any] = {
    "n_layer": 1,
    "n_head": 2,
    "n_embd": 32,
    "block_size": 16,
    "micro_batch_size": 1,
    "eval_interval": 0,
    "checkpoint_interval": 0,
    "lr": 0.01,
    "device": "cpu",
}
# Each setting: the simulated sizes, the global batch (divisible by every size; "batches" may give one per size),
# steps, replicas, whether the fp32 band is trained too, and the worker processes (None: one per CPU).
DP_BAND_FULL: dict[str, Any] = {"sizes": (4, 1024), "global_batch_size": 1024, "steps": 40, "replicas": 8}
DP_BAND_DEFAULT: dict[str, Any] = {
    "sizes": (4, 1024),
    "global_batch_size": 1024,
    "batches": {4: 64},
    "steps": 12,
    "replicas": 4,
    "fp32_band": False,
}
DP_BAND_QUICK: dict[str, Any] = {
    "sizes": (4, 16),
    "global_batch_size": 16,
    "steps": 6,
    "replicas": 2,
    "fp32_band": False,
    "workers": 1,
}
_WIDEN, _PERSIST = 1.0, 3


def plan_dp_band(out_dir: str, seed: int, setting: dict[str, Any]) -> list[tuple[int, str, TrainConfig]]:
    """(P, role, configuration) of every run: roles 'band-fp32' and 'band-bf16acc' (replicas; replica 0 of the
    latter is the bf16 fp32-accumulate variant itself) and 'bf16-native'."""
    plan = []
    for size in setting["sizes"]:
        base = {
            **STUDY_BASE,
            "global_batch_size": setting.get("batches", {}).get(size, setting["global_batch_size"]),
            "steps": setting["steps"],
            "seed": seed,
            "simulate_dp": size,
        }
        where = os.path.join(out_dir, "dp-band", f"P{size}")
        bands = (("band-fp32", "fp32", "fp32_accumulate"),) if setting.get("fp32_band", True) else ()
        for role, precision, reduce in (*bands, ("band-bf16acc", "bf16", "fp32_accumulate")):
            band = TrainConfig.from_fields(
                {**base, "precision": precision, "reduce": reduce, "out_dir": os.path.join(where, role)}
            )
            plan += [(size, role, cfg) for cfg in replica_configs(band, setting["replicas"])]
        cfg = {**base, "precision": "bf16", "reduce": "native", "out_dir": os.path.join(where, "bf16-native")}
        plan.append((size, "bf16-native", TrainConfig.from_fields(cfg)))
    return plan


def _judge(
    replicas: list[RunLog], variants: list[RunLog], band: str, size: int
) -> tuple[list[str], list[str], list[BandVerdict], int]:
    verdicts, spread = band_verdicts(replicas, variants, widen=_WIDEN, persist=_PERSIST)
    alarms = false_alarms(replicas, widen=_WIDEN, persist=_PERSIST)
    table = format_band_table(verdicts, spread, replicas=len(replicas), widen=_WIDEN, persist=_PERSIST, alarms=alarms)
    summary = []
    for v in verdicts:
        verdict = "stays inside" if v.leaves_at is None else f"leaves ({v.side}) at step {v.leaves_at}"
        summary.append(
            f"P = {size}: {v.name} {verdict} the {band} band "
            f"({v.outside:.0%} of steps outside; final loss {v.final:.4f}, z = {v.z_final:+.1f})"
        )
    return ["", f"Against the {band} band:", "", table], summary, verdicts, alarms


def _headline(size: int, native: BandVerdict, replicas: int, alarms: int, steps: int) -> str:
    """What the native run against the bf16 fp32-accumulate band at the largest DP means for a user."""
    head = f"at simulated DP {size}, bf16 gradients summed by the backend's native ring ({size - 1} roundings to bf16)"
    if native.leaves_at is None:
        inside = (
            f"{head} stay inside the band of {replicas} fp32-accumulate replicas over {steps} steps (final z = "
            f"{native.z_final:+.1f}): no effect of the reduction's precision measurable at this size"
        )
        if replicas < 3:
            return inside + f"; a band of {replicas} replicas is a first look, `mixprec demo --full` decides it"
        return inside + "; the native reduction does as well as the fp32 sum here"
    where = (
        f"{head} leave the band of {replicas} fp32-accumulate replicas ({native.side}) at step {native.leaves_at} "
        f"({native.outside:.0%} of steps outside, final z = {native.z_final:+.1f})"
    )
    if replicas >= 3 and alarms == 0:
        return (
            where
            + ", and no replica leaves the band of the others: use `--parallel.reduce fp32_accumulate` at this scale"
        )
    calibration = (
        f"{alarms} of the {replicas} replicas also {'leaves' if alarms == 1 else 'leave'} the band of the others "
        "(false alarms)"
        if replicas >= 3
        else f"{replicas} replicas cannot calibrate the band"
    )
    return (
        where + f", but {calibration}: a hint, not a verdict; `mixprec demo --full` (more replicas and steps) "
        "decides it, and `--parallel.reduce fp32_accumulate` is the safe choice meanwhile"
    )


def run_dp_band(
    out_dir: str, seed: int, setting: dict[str, Any], *, progress: bool | None = None
) -> tuple[str, Verdicts]:
    """Train every run of :func:`plan_dp_band`; returns the report section (markdown) and one verdict line per
    size, variant and band (``headline``: the native reduction against the fp32-accumulate band at the largest
    size)."""
    del progress  # the runs train in worker processes, silently
    plan = plan_dp_band(out_dir, seed, setting)
    failures = train_all([cfg for _, _, cfg in plan], workers=setting.get("workers"), label="simulated DP bands:")
    if any(failures):
        raise RuntimeError(f"internal error: a simulated-DP band run failed: {failures}")
    fp32_band = setting.get("fp32_band", True)
    batches = ", ".join(
        f"{setting.get('batches', {}).get(size, setting['global_batch_size'])} at P = {size}"
        for size in setting["sizes"]
    )
    lines = [
        "## Reduction precision at simulated data-parallel sizes",
        "",
        f"A GPT of {STUDY_BASE['n_layer']} layer, width {STUDY_BASE['n_embd']}, global batch ({batches}) sequences "
        f"of {STUDY_BASE['block_size']}, micro batch 1, {setting['steps']} steps, trained with "
        "`--parallel.simulate-dp P` "
        f"(bit-exact models of the reductions). Bands of {setting['replicas']} replicas, differing only in one ulp "
        "of the initial weights: bf16 with the fp32-accumulate reduction (its replica 0 is the bf16-fp32acc variant; "
        "against this band the native run, gloo's ring rounding to bf16 at each of its P - 1 hops, differs from it "
        "in the reduction alone)"
        + (
            " and fp32 (what chaos does to the fp32 reference)."
            if fp32_band
            else ". (Against an fp32 band every bf16 run leaves at step 0 from its bf16 parameters alone, whatever the "
            "reduction: `mixprec demo --full` trains that band too.)"
        ),
    ]
    summary: list[str] = []
    headline = ""
    for size in setting["sizes"]:
        runs = {
            role: [
                load_run(cfg.training.out_dir, f"{role}/{os.path.basename(cfg.training.out_dir)}")
                for s, r, cfg in plan
                if s == size and r == role
            ]
            for role in ("band-fp32", "band-bf16acc", "bf16-native")
            if fp32_band or role != "band-fp32"
        }
        native = [load_run(runs["bf16-native"][0].path, "bf16-native")]
        acc = [load_run(runs["band-bf16acc"][0].path, "bf16-fp32acc")]
        lines += ["", f"### P = {size}"]
        judged = [(runs["band-fp32"], native + acc, "fp32")] if fp32_band else []
        for replicas, variants, band in (*judged, (runs["band-bf16acc"], native, "bf16 fp32-accumulate")):
            more, said, verdicts, alarms = _judge(replicas, variants, band, size)
            lines += more
            summary += said
        if size == max(setting["sizes"]):
            headline = _headline(size, verdicts[0], len(runs["band-bf16acc"]), alarms, setting["steps"])
    lines += ["", "Verdicts:", "", *[f"- {s}" for s in summary]]
    return "\n".join(lines) + "\n", Verdicts(summary, headline)
