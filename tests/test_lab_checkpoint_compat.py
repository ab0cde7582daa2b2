"""Resuming from checkpoints of older mixprec versions, and unreadable checkpoint files."""

from __future__ import annotations

import pytest
import torch

from mixprec.lab.checkpoint import load_checkpoint
from mixprec.lab.train import _check_legacy_reducer_state, _is_legacy_reducer_state


def test_old_round_to_nearest_reducer_state_is_accepted_and_stateful_ones_are_refused() -> None:
    old_nearest = {"rounding": "nearest", "seed": 0}  # what the reducers wrote before the wrapper's envelope
    assert _is_legacy_reducer_state(old_nearest)
    _check_legacy_reducer_state(old_nearest)  # nothing to restore: skipped, the resume stays bit-exact
    for stateful in (
        {"rounding": "stochastic", "seed": 0, "generator_state": torch.zeros(8, dtype=torch.uint8)},
        {"rounding": "nearest", "residuals": {0: torch.zeros(4)}},
    ):
        with pytest.raises(ValueError, match="older mixprec"):
            _check_legacy_reducer_state(stateful)
    current = {"format": "mixprec.ddp_reducer/1", "state": {"rounding": "stochastic"}}
    assert not _is_legacy_reducer_state(current)
    _check_legacy_reducer_state(current)


@pytest.mark.parametrize("content", [b"garbage", b"PK\x03\x04truncated zip"])
def test_unreadable_checkpoint_is_a_value_error(tmp_path, content: bytes) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(content)
    for mmap in (False, True):
        with pytest.raises(ValueError, match="not a readable mixprec train checkpoint"):
            load_checkpoint(str(path), mmap=mmap)
