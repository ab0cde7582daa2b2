"""What ``mixprec train`` asks of a gradient reducer of the registry, asked of the reducer itself.

``parallel.reduce`` names a reducer of :func:`mixprec.comm.make_reducer` (``mixprec.parallel`` and
``mixprec.compress`` register them). Which ``[parallel]`` fields apply to it, and how they become its options, is
answered here by building the reducer with the registry: the options its factory takes (a wrong one is refused by
name), the wires it accepts, whether it defaults to a two-stage topology. No reducer name is compared anywhere in
the lab, so a reducer registered tomorrow is configured, launched and simulated by the same code.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any
from unittest import mock

import mixprec.compress  # registers the compressed reducers
import mixprec.parallel  # noqa: F401  (registers native, fp32_accumulate, fp32_accumulate_hierarchical)
from mixprec.comm import make_reducer, registered_reducers
from mixprec.compress.options import WIRES

__all__ = ["ADAPTIVE_WIRE", "ReducerTraits", "reducer_traits"]

# The wire of the reducer that picks a wire per bucket from the link rate (compress/auto.py).
ADAPTIVE_WIRE = "auto"
# Options a [parallel] field may become, with a value every reducer taking them accepts: probed one at a time.
_PROBES: dict[str, Any] = {"rounding": "nearest", "error_feedback": False, "algorithm": "ring", "link_gbps": 1.0}


@dataclass(frozen=True)
class ReducerTraits:
    """One registered reducer, as the lab configures it."""

    name: str
    options: frozenset[str]
    """The options of ``_PROBES`` that its factory takes."""
    wires: tuple[str, ...]
    """The wires of :data:`mixprec.compress.options.WIRES` it accepts (``wire=``); empty when it takes none."""
    hierarchical: bool
    """Built with default options, it reduces in two stages (it has a topology): it needs ranks_per_node."""

    @property
    def compressed(self) -> bool:
        """It quantizes the wire and can keep error-feedback residuals."""
        return "error_feedback" in self.options

    @property
    def adaptive(self) -> bool:
        """It chooses each bucket's wire from a cost model of the link rate (``link_gbps``)."""
        return ADAPTIVE_WIRE in self.wires

    def wire_for(self, element_format: str) -> str | None:
        """The wire that carries fp8 elements of ``element_format`` ('e4m3', 'e5m2') when this reducer offers a
        choice of fp8 wires (the plain fp8 wire is named by its format, a block-scaled one ends with it); None
        when it has no such choice."""
        if len(self.wires) < 2:
            return None
        for wire in self.wires:
            if wire == element_format or wire.endswith("_" + element_format):
                return wire
        raise ValueError(f"parallel.fp8_format {element_format!r}: reduce {self.name!r} offers wires {self.wires}")


def _takes(name: str, **option: Any) -> bool:
    try:
        make_reducer(name, **option)
    except (TypeError, ValueError):
        return False
    return True


def _has_topology(reducer: Any) -> bool:
    # The compressed reducers keep their topology in their validated options, the fp32 ones on themselves.
    return getattr(getattr(reducer, "options", reducer), "topology", None) is not None


@functools.cache
def reducer_traits(name: str) -> ReducerTraits:
    """The traits of the reducer registered as ``name`` (ValueError naming ``parallel.reduce`` if there is none)."""
    if name not in registered_reducers():
        raise ValueError(f"parallel.reduce must be one of {', '.join(registered_reducers())}; got {name!r}")
    # A two-stage reducer built without a topology reads torchrun's LOCAL_WORLD_SIZE: one rank per node will do.
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "1"}):
        options = frozenset(k for k, v in _PROBES.items() if _takes(name, **{k: v}))
        wires = tuple(w for w in WIRES if _takes(name, wire=w))
        hierarchical = _has_topology(make_reducer(name))
    return ReducerTraits(name, options, wires, hierarchical)
