"""Collectives with low-precision wire formats and fp32 accumulation."""

from mixprec.comm.agree import agree_any, collective_device, is_distributed

__all__ = ["agree_any", "collective_device", "is_distributed"]
