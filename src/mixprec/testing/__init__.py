"""Helpers for testing distributed numerics: a fork-based gloo harness."""

from mixprec.testing.multiprocess import RankFailedError, run_distributed

__all__ = ["RankFailedError", "run_distributed"]
