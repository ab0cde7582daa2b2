"""The numerics lab: training runs (``mixprec train``), comparisons (``mixprec compare``), the demo and studies.

Public names, imported on first use (so that ``mixprec study`` does not pay for the training stack):

* :class:`TrainConfig` (mixprec.lab.config): everything that defines a run.
* :func:`launch` (mixprec.lab.launch): run a TrainConfig here, as ``nproc`` watched ranks, or under torchrun;
  :class:`TrainingFailed` when a rank fails; :class:`TrainingDiverged` (mixprec.lab.train) when a run without a
  dynamic loss scaler skips ``max_consecutive_skips`` steps in a row.
* :func:`load_run`, :func:`compare_runs`, :func:`format_table`, :func:`plot_comparison` (mixprec.lab.compare).
* :func:`run_demo` (mixprec.lab.demo).
* :class:`GPT`, :class:`GPTConfig` (mixprec.lab.model), :func:`load_corpus` (mixprec.lab.corpus).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "TrainConfig": "mixprec.lab.config",
    "launch": "mixprec.lab.launch",
    "TrainingFailed": "mixprec.lab.launch",
    "TrainingDiverged": "mixprec.lab.train",
    "load_run": "mixprec.lab.compare",
    "compare_runs": "mixprec.lab.compare",
    "format_table": "mixprec.lab.compare",
    "plot_comparison": "mixprec.lab.compare",
    "run_demo": "mixprec.lab.demo",
    "GPT": "mixprec.lab.model",
    "GPTConfig": "mixprec.lab.model",
    "load_corpus": "mixprec.lab.corpus",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mixprec.lab' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
