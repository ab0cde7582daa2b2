"""8-bit min-max gradient compression (after Bagua's ByteGrad): quantizer, compressed collectives, reducers."""

from mixprec.compress.quantize import HEADER_BYTES_PER_CHUNK, MinMaxUInt8, NonFiniteError

__all__ = ["HEADER_BYTES_PER_CHUNK", "MinMaxUInt8", "NonFiniteError"]
