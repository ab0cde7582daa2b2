"""8-bit min-max gradient compression (after Bagua's ByteGrad): quantizer, compressed collectives, reducers.

* :class:`MinMaxUInt8`: per-chunk min-max uint8 quantizer with a documented wire format.
* :func:`compressed_all_reduce` / :func:`compressed_reduce_scatter`: uint8 on the wire, fp32 sums, flat or
  hierarchical (:class:`Topology`), optional :class:`ErrorFeedback`, per-call :class:`CompressionStats`.
* Reducers ``"uint8"`` and ``"uint8_hierarchical"`` for :class:`mixprec.parallel.DistributedDataParallel`
  (registered when this package is imported) and :func:`uint8_compress_hook` for torch DDP, both
  configured by one validated :class:`Uint8Options`.
"""

from mixprec.compress.collectives import (
    CompressedReduction,
    CompressionStats,
    CompressionWorkspace,
    ErrorFeedback,
    compressed_all_reduce,
    compressed_reduce_scatter,
    start_compressed_all_reduce,
    start_compressed_reduce_scatter,
)
from mixprec.compress.hooks import Uint8HookState, uint8_compress_hook
from mixprec.compress.options import Uint8Options
from mixprec.compress.quantize import HEADER_BYTES_PER_CHUNK, MinMaxUInt8, NonFiniteError
from mixprec.compress.reducers import Uint8Reducer  # registers "uint8" and "uint8_hierarchical"
from mixprec.compress.topology import Topology

__all__ = [
    "HEADER_BYTES_PER_CHUNK",
    "CompressedReduction",
    "CompressionStats",
    "CompressionWorkspace",
    "ErrorFeedback",
    "MinMaxUInt8",
    "NonFiniteError",
    "Topology",
    "Uint8HookState",
    "Uint8Options",
    "Uint8Reducer",
    "compressed_all_reduce",
    "compressed_reduce_scatter",
    "start_compressed_all_reduce",
    "start_compressed_reduce_scatter",
    "uint8_compress_hook",
]
