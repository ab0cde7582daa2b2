"""Batches as pure functions of (seed, step): the data position is the step number, nothing else to save.

Step ``k`` draws ``global_batch_size`` window starts from a generator seeded by ``(seed, k)``; rank ``r`` of
``W`` takes rows ``[r * GBS / W, (r + 1) * GBS / W)`` and cuts them into microbatches of ``micro_batch_size``.
So one rank with GBS sequences and two ranks with GBS / 2 each see the same global batch, and a resumed run
sees the batches the uninterrupted one would have.

Evaluation uses a fixed set of ``eval_sequences`` windows of the validation split (seeded by ``seed`` alone),
cut into chunks of ``micro_batch_size`` that are dealt to ranks round-robin: a chunk's loss does not depend on
the number of ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "check_corpus_fits",
    "dropout_seed",
    "eval_chunks",
    "linear_rounding_seed",
    "step_seed",
    "train_microbatches",
]

_PURPOSE_TRAIN = 1
_PURPOSE_EVAL = 2
_PURPOSE_DROPOUT = 3
_PURPOSE_LINEAR = 4


def step_seed(seed: int, purpose: int, *more: int) -> int:
    """A 64-bit seed mixed from integers with numpy's SeedSequence (no collisions between nearby inputs)."""
    return int(np.random.SeedSequence([seed, purpose, *more]).generate_state(1, dtype=np.uint64)[0])


def dropout_seed(seed: int, step: int, rank: int) -> int:
    return step_seed(seed, _PURPOSE_DROPOUT, step, rank)


def linear_rounding_seed(seed: int, step: int, rank: int) -> int:
    """Seed of rank ``rank``'s block-scaled linear layers at step ``step``: their stochastic rounding of the
    gradients and their random Hadamard signs (``model.linear_mode = "nvfp4"``)."""
    return step_seed(seed, _PURPOSE_LINEAR, step, rank)


def _windows(tokens: torch.Tensor, starts: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(block_size + 1)  # (B, T+1)
    w = tokens[idx]  # (B, T+1)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # inputs (B, T), targets (B, T)


def _check_split(tokens: torch.Tensor, block_size: int, split: str) -> int:
    span = tokens.numel() - block_size - 1
    if span < 1:
        raise ValueError(
            f"the {split} split holds {tokens.numel()} characters, too few for block_size {block_size}; "
            "use a larger corpus or a smaller block_size"
        )
    return span


def check_corpus_fits(corpus: Any, *, block_size: int) -> None:
    """Raise ValueError unless both splits of ``corpus`` (a :class:`mixprec.lab.corpus.Corpus`) hold a window of
    ``block_size + 1`` characters: what batching and evaluation will need."""
    _check_split(corpus.train, block_size, "training")
    _check_split(corpus.val, block_size, "validation")


def train_microbatches(
    tokens: torch.Tensor,
    *,
    seed: int,
    step: int,
    global_batch_size: int,
    micro_batch_size: int,
    block_size: int,
    rank: int,
    world_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's microbatches of step ``step``: a list of (inputs, targets), each int64 ``(MBS, T)``."""
    span = _check_split(tokens, block_size, "training")
    gen = torch.Generator().manual_seed(step_seed(seed, _PURPOSE_TRAIN, step))
    starts = torch.randint(0, span, (global_batch_size,), generator=gen)
    per_rank = global_batch_size // world_size
    mine = starts[rank * per_rank : (rank + 1) * per_rank]
    return [_windows(tokens, s, block_size) for s in mine.split(micro_batch_size)]


def eval_chunks(
    tokens: torch.Tensor,
    *,
    seed: int,
    eval_sequences: int,
    micro_batch_size: int,
    block_size: int,
    rank: int,
    world_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the fixed validation windows, in chunks of at most ``micro_batch_size``."""
    span = _check_split(tokens, block_size, "validation")
    gen = torch.Generator().manual_seed(step_seed(seed, _PURPOSE_EVAL))
    starts = torch.randint(0, span, (eval_sequences,), generator=gen)
    chunks = starts.split(micro_batch_size)
    return [_windows(tokens, c, block_size) for c in chunks[rank::world_size]]
