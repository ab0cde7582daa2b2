"""Compressed gradient reduction (8-bit min-max after Bagua's ByteGrad, fp8, MX / NVFP4): wires, collectives, reducers.

* :class:`MinMaxUInt8`: per-chunk min-max uint8 quantizer (0 decodes to 0) with a documented wire format;
  :class:`ScaledFP8`: fp8 e4m3/e5m2 codes with a power-of-two scale per chunk; :class:`BlockScaledWire`:
  MXFP8 / MXFP4 / NVFP4 with the block scales inline; any of them goes on the wire.
* :func:`compressed_all_reduce` / :func:`compressed_reduce_scatter`: uint8 on the wire, fp32 sums, flat or
  hierarchical (a :class:`mixprec.comm.Topology`), optional :class:`ErrorFeedback`, per-call
  :class:`CompressionStats`.
* :class:`CompressedReducer`: the reducers ``"uint8"``, ``"fp8"``, ``"mxfp8"``, ``"nvfp4"`` (each also
  ``_hierarchical``) and ``"auto"`` for :class:`mixprec.parallel.DistributedDataParallel` (registered when this
  package is imported), configured by one validated :class:`CompressionOptions`, as is the torch DDP hook
  :func:`mixprec.hooks.compressed_hook`.

Deprecated names, importable with a DeprecationWarning: ``Uint8Reducer`` (now :class:`CompressedReducer`),
``Uint8Options`` (now :class:`CompressionOptions`), ``Topology`` (its home is :mod:`mixprec.comm`).
"""

import warnings
from typing import Any

from mixprec.comm.topology import Topology as _Topology
from mixprec.compress.blockscaled import BlockScaledWire
from mixprec.compress.collectives import (
    compressed_all_reduce,
    compressed_reduce_scatter,
    start_compressed_all_reduce,
    start_compressed_reduce_scatter,
)
from mixprec.compress.fp8 import ScaledFP8
from mixprec.compress.options import CompressionOptions
from mixprec.compress.quantize import MinMaxUInt8, NonFiniteError
from mixprec.compress.reducers import CompressedReducer  # registers the compressed reducers
from mixprec.compress.state import CompressionStats, ErrorFeedback

__all__ = [
    "BlockScaledWire",
    "CompressedReducer",
    "CompressionOptions",
    "CompressionStats",
    "ErrorFeedback",
    "MinMaxUInt8",
    "NonFiniteError",
    "ScaledFP8",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "start_compressed_all_reduce",
    "start_compressed_reduce_scatter",
]

# Old public name -> (the object, the path to use now). Out of __all__, so ``from mixprec.compress import *``
# does not warn; nothing inside mixprec uses them (tests/test_compress_names.py checks).
_DEPRECATED: dict[str, tuple[Any, str]] = {
    "Uint8Reducer": (CompressedReducer, "mixprec.compress.CompressedReducer"),
    "Uint8Options": (CompressionOptions, "mixprec.compress.CompressionOptions"),
    "Topology": (_Topology, "mixprec.comm.Topology"),
}


def __getattr__(name: str) -> Any:
    entry = _DEPRECATED.get(name)
    if entry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    obj, new_path = entry
    warnings.warn(
        f"mixprec.compress.{name} is deprecated and will be removed in a later release; use {new_path}",
        DeprecationWarning,
        stacklevel=2,
    )
    return obj


def __dir__() -> list[str]:
    return sorted([*globals(), *_DEPRECATED])
