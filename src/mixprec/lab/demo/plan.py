"""The five runs of ``mixprec demo``: what each one changes, the settings they share, and their configurations.

The same GPT, seed and batches on ``nproc`` gloo ranks: ``fp32`` (the reference), ``bf16-native`` (the backend
sums in bf16), ``bf16-fp32acc`` (bf16 wire, fp32 sum), ``fp16-dynamic`` (dynamic loss scaling) and ``uint8``
(8-bit min-max codes on the wire). :func:`plan_demo` builds and checks every configuration before a run starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mixprec.lab.config import TrainConfig
from mixprec.lab.studies.base import DEFAULT_SEED

__all__ = [
    "DEFAULT_OUT_DIR",
    "DEFAULT_THRESHOLD",
    "DEMO_DEFAULTS",
    "DEMO_RUNS",
    "QUICK_OVERRIDES",
    "DemoRun",
    "RunOutcome",
    "plan_demo",
]

DEFAULT_OUT_DIR = "mixprec-demo"
# The absolute loss difference whose first crossing the comparison reports.
DEFAULT_THRESHOLD = 0.05


@dataclass(frozen=True)
class DemoRun:
    """One run of the demo: a name (its directory and label), what it shows, and its TrainConfig overrides."""

    name: str
    description: str
    overrides: dict[str, Any]


DEMO_RUNS: tuple[DemoRun, ...] = (
    DemoRun("fp32", "fp32, the reference", {"precision": "fp32", "reduce": "native"}),
    DemoRun(
        "bf16-native", "bf16, native reduction: the backend sums in bf16", {"precision": "bf16", "reduce": "native"}
    ),
    DemoRun(
        "bf16-fp32acc",
        "bf16, fp32-accumulate reduction: bf16 wire, fp32 sum",
        {"precision": "bf16", "reduce": "fp32_accumulate"},
    ),
    DemoRun("fp16-dynamic", "fp16, dynamic loss scaling", {"precision": "fp16", "kind": "dynamic"}),
    DemoRun("uint8", "fp32, uint8-compressed reduction: ByteGrad scheme", {"precision": "fp32", "reduce": "uint8"}),
)

# 0.45M parameters, 4 ranks x 2 microbatches x 4 sequences x 64 characters = 2048 tokens per step.
DEMO_DEFAULTS: dict[str, Any] = {
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 128,
    "block_size": 64,
    "global_batch_size": 32,
    "micro_batch_size": 4,
    "nproc": 4,
    "steps": 200,
    "eval_interval": 25,
    "eval_sequences": 64,
    "checkpoint_interval": 0,
    "lr": 2e-3,
    # fp16: start high so that the first steps overflow and the scaler visibly backs off, then grows again.
    "init_scale": 2.0**16,
    "growth_interval": 50,
    # The demo studies the CPU emulation on gloo ranks, also on a machine that has a GPU.
    "device": "cpu",
}

# A few seconds in total: for tests and a first look.
QUICK_OVERRIDES: dict[str, Any] = {
    "n_layer": 1,
    "n_embd": 32,
    "block_size": 16,
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "nproc": 2,
    "steps": 12,
    "eval_interval": 6,
    "eval_sequences": 8,
    "growth_interval": 4,
}


def plan_demo(
    *,
    out_dir: str = DEFAULT_OUT_DIR,
    seed: int = DEFAULT_SEED,
    overrides: dict[str, Any] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    runs: Sequence[DemoRun] = DEMO_RUNS,
) -> list[TrainConfig]:
    """The configuration of each of ``runs``, every argument checked before any run starts.

    Raises:
        ValueError, TypeError: a bad threshold, or overrides that make a run's configuration invalid.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not threshold >= 0:
        raise ValueError(f"threshold must be a number >= 0 (an absolute loss difference); got {threshold!r}")
    if not runs:
        raise ValueError("runs must name at least one demo run")
    base = {**DEMO_DEFAULTS, **(overrides or {}), "seed": seed}
    return [
        TrainConfig.from_fields({**base, **demo_run.overrides, "out_dir": os.path.join(out_dir, "runs", demo_run.name)})
        for demo_run in runs
    ]


@dataclass
class RunOutcome:
    """What became of one demo run: ``status`` "ok" or "failed" (with the reason in ``detail``)."""

    run: DemoRun
    status: str
    detail: str = ""
    seconds: float = 0.0
