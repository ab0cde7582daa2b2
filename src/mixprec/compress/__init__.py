"""8-bit min-max gradient compression (after Bagua's ByteGrad): quantizer, compressed collectives, reducers.

* :class:`MinMaxUInt8`: per-chunk min-max uint8 quantizer (0 decodes to 0) with a documented wire format;
  :class:`ScaledFP8`: fp8 e4m3/e5m2 codes with a power-of-two scale per chunk; :class:`BlockScaledWire`:
  MXFP8 / MXFP4 / NVFP4 with the block scales inline; any of them goes on the wire.
* :func:`compressed_all_reduce` / :func:`compressed_reduce_scatter`: uint8 on the wire, fp32 sums, flat or
  hierarchical (:class:`Topology`), optional :class:`ErrorFeedback`, per-call :class:`CompressionStats`.
* Reducers ``"uint8"`` and ``"uint8_hierarchical"`` for :class:`mixprec.parallel.DistributedDataParallel`
  (registered when this package is imported), configured by one validated :class:`Uint8Options`, as is
  the torch DDP hook :func:`mixprec.hooks.uint8_compress_hook`.
* :class:`Topology`: nodes x ranks per node, for the hierarchical schemes.
"""

from mixprec.comm.topology import Topology
from mixprec.compress.blockscaled import BlockScaledWire
from mixprec.compress.collectives import (
    compressed_all_reduce,
    compressed_reduce_scatter,
    start_compressed_all_reduce,
    start_compressed_reduce_scatter,
)
from mixprec.compress.fp8 import ScaledFP8
from mixprec.compress.options import Uint8Options
from mixprec.compress.quantize import MinMaxUInt8, NonFiniteError
from mixprec.compress.reducers import Uint8Reducer  # registers "uint8" and "uint8_hierarchical"
from mixprec.compress.state import CompressionStats, ErrorFeedback

__all__ = [
    "BlockScaledWire",
    "CompressionStats",
    "ErrorFeedback",
    "MinMaxUInt8",
    "NonFiniteError",
    "ScaledFP8",
    "Topology",
    "Uint8Options",
    "Uint8Reducer",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "start_compressed_all_reduce",
    "start_compressed_reduce_scatter",
]
