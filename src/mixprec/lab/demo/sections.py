"""The demo's three measured sections at simulated data-parallel sizes: reduction precision against a noise band
(mixprec.lab.dp_band), the loss-scale rules (studies.scale_study) and the uint8 run's offset (studies.uint8_study),
each at one of three sizes (quick, default, full); their report sections, verdict lines and headlines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

__all__ = ["HEADLINE_TITLES", "STUDY_SIZES", "Studies", "plan_studies", "run_studies"]

STUDY_SIZES = ("quick", "default", "full")


def _study_settings(size: str) -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, run function, setting) of each study section at ``size``."""
    from mixprec.lab import dp_band
    from mixprec.lab.studies import scale_study, uint8_study

    pick = {"quick": 0, "default": 1, "full": 2}[size]
    return [
        (
            "simulated-DP bands",
            dp_band.run_dp_band,
            (dp_band.DP_BAND_QUICK, dp_band.DP_BAND_DEFAULT, dp_band.DP_BAND_FULL)[pick],
        ),
        (
            "loss scale",
            scale_study.run_scale_study,
            (scale_study.SCALE_QUICK, scale_study.SCALE_DEFAULT, scale_study.SCALE_FULL)[pick],
        ),
        (
            "uint8 offset",
            uint8_study.run_uint8_study,
            (uint8_study.UINT8_QUICK, uint8_study.UINT8_DEFAULT, uint8_study.UINT8_FULL)[pick],
        ),
    ]


def plan_studies(out_dir: str, seed: int, size: str) -> None:
    """Check every study run's configuration before the first run starts (ValueError when one is invalid)."""
    from mixprec.lab import dp_band
    from mixprec.lab.studies import scale_study, uint8_study

    if size not in STUDY_SIZES:
        raise ValueError(f"study size must be one of {', '.join(STUDY_SIZES)}; got {size!r}")
    for name, _, setting in _study_settings(size):
        if name == "simulated-DP bands":
            dp_band.plan_dp_band(out_dir, seed, setting)
        elif name == "loss scale":
            scale_study.plan_scale_study(out_dir, seed, setting)
        else:
            uint8_study.plan_uint8_study(out_dir, seed, setting)


@dataclass
class Studies:
    """What :func:`run_studies` measured: the report's sections (markdown), every verdict line (prefixed by its
    study), each study's headline (title, sentence) and wall time, at ``size``."""

    size: str
    sections: str
    verdicts: list[str]
    headlines: list[tuple[str, str]]
    seconds: dict[str, float]


# The report's opening verdicts: one per study, under these titles, in the order of _study_settings.
HEADLINE_TITLES = {
    "simulated-DP bands": "Reduction precision at large DP",
    "loss scale": "Loss-scale rule",
    "uint8 offset": "uint8 compression or chaos",
}


def run_studies(out_dir: str, seed: int, size: str) -> Studies:
    """Run the three study sections (reduction precision at simulated DP, the loss-scale rules, the uint8 offset)
    at ``size``; returns their sections, verdict lines, headlines and wall times."""
    sections, verdicts, headlines, seconds = [], [], [], {}
    for name, run, setting in _study_settings(size):
        t0 = time.perf_counter()
        section, said = run(out_dir, seed, setting)
        seconds[name] = time.perf_counter() - t0
        sections.append(section + f"\n({name}: {seconds[name]:.0f} s)\n")
        verdicts += [f"[{name}] {s}" for s in said]
        headlines.append((HEADLINE_TITLES[name], said.headline))
        print(f"mixprec demo: {name}: {seconds[name]:.0f} s", flush=True)
    return Studies(size, "\n".join(sections), verdicts, headlines, seconds)
