"""Shared fixtures. Multi-process tests use ``dist_run`` (fork + gloo, see mixprec.testing)."""

from __future__ import annotations

import os

import pytest
import torch

from mixprec.testing import run_distributed

# Tests run on a 2-core CI machine; more intra-op threads only add contention with forked ranks.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# The first torch optimizer built in a process imports torch._dynamo (seconds). Build one here, in the parent,
# so that every forked rank inherits the imported modules instead of paying again.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


@pytest.fixture
def dist_run():
    """``dist_run(fn, world_size, *args, timeout=120, **kwargs) -> [result per rank]``."""
    return run_distributed


@pytest.fixture
def one_thread():
    """The 1-rank reference runs in this process: give it the thread count of a forked rank (1), so that its
    matmuls split their work exactly as the ranks' do."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
