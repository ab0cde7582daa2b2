"""Which optional mixprec capabilities this installation has, and a clear error when a run needs a missing one.

``mixprec train`` options map onto subpackages that may be absent (a trimmed install, or a development tree
where they have not landed yet): the data-parallel wrapper (``mixprec.parallel.DistributedDataParallel``), its
reducers (``fp32_accumulate``; ``uint8`` and ``uint8_hierarchical`` from ``mixprec.compress``) and the precision
emulator (``mixprec.emulate.emulate_linear_layers``). A run that needs one that is missing is refused before any
rank starts, naming the option and the missing piece.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["CapabilityError", "missing_capabilities", "reduction_available"]


class CapabilityError(ValueError):
    """A requested option needs a mixprec capability that this installation does not have."""


def _attr(module: str, name: str) -> Any | None:
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def has_data_parallel() -> bool:
    return _attr("mixprec.parallel", "DistributedDataParallel") is not None


def reduction_available(name: str) -> str | None:
    """None when ``reduce=name`` can run on several ranks, else why not."""
    if not has_data_parallel():
        return f"reduce={name!r} needs mixprec.parallel.DistributedDataParallel, which is not available yet"
    if name == "native":
        return None
    registered = _attr("mixprec.comm", "registered_reducers")
    if name.startswith("uint8"):
        try:
            importlib.import_module("mixprec.compress")
        except ImportError as exc:
            return f"reduce={name!r} needs mixprec.compress, which cannot be imported ({exc})"
    names = registered() if callable(registered) else ()
    if name not in names:
        where = "mixprec.compress" if name.startswith("uint8") else "mixprec.parallel"
        return f"reduce={name!r} is not registered by {where} yet (registered: {', '.join(names) or 'none'})"
    return None


def missing_capabilities(cfg: Any) -> list[str]:
    """Why ``cfg`` (a TrainConfig) cannot run here; empty when it can."""
    problems: list[str] = []
    if cfg.nproc > 1:
        why = reduction_available(cfg.reduce)
        if why:
            problems.append(why)
    if cfg.sharded_optimizer and not has_data_parallel():
        problems.append("sharded_optimizer needs mixprec.parallel.DistributedDataParallel, which is not available yet")
    if cfg.linear_mode != "off" and _attr("mixprec.emulate", "emulate_linear_layers") is None:
        problems.append(
            f"linear_mode={cfg.linear_mode!r} needs mixprec.emulate.emulate_linear_layers, which is not available yet"
        )
    return problems


def check_capabilities(cfg: Any) -> None:
    """Raise :class:`CapabilityError` listing every missing capability ``cfg`` needs."""
    problems = missing_capabilities(cfg)
    if problems:
        raise CapabilityError("; ".join(problems))
