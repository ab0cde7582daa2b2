"""``mixprec demo``: the same model, seed and batches trained five ways, compared, and explained in ``report.md``.

The runs (same GPT, same seed, same batches, ``nproc`` gloo ranks):

1. ``fp32``: the reference.
2. ``bf16-native``: bf16 parameters and gradients, reduced by the backend's own collective (it sums in bf16).
3. ``bf16-fp32acc``: the same, reduced with a bf16 wire and an fp32 sum (one rounding per element).
4. ``fp16-dynamic``: fp16 parameters and gradients with dynamic loss scaling.
5. ``uint8``: fp32 gradients sent as 8-bit min-max codes.

Runs that need a capability this installation lacks are listed in the report as not run, with the reason. The
report's sentences are generated from the measured metrics; nothing in them is canned. :func:`run_studies` adds
the studies at simulated data-parallel sizes (mixprec.lab.dp_band, lab.studies.scale_study, uint8_study).

Modules: ``plan`` (the runs and their configurations), ``runs`` (:func:`run_demo`), ``report`` (``report.md``),
``sections`` (the three study sections).
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, as mixprec.lab does: the command line reads the plan's defaults without the training stack.
_LAZY = {
    "DEMO_DEFAULTS": "plan",
    "DEMO_RUNS": "plan",
    "DEFAULT_OUT_DIR": "plan",
    "DEFAULT_THRESHOLD": "plan",
    "QUICK_OVERRIDES": "plan",
    "DemoRun": "plan",
    "plan_demo": "plan",
    "write_report": "report",
    "run_demo": "runs",
    "HEADLINE_TITLES": "sections",
    "STUDY_SIZES": "sections",
    "Studies": "sections",
    "plan_studies": "sections",
    "run_studies": "sections",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec.lab.demo' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mixprec.lab.demo.{module}"), name)
