"""Per-rank random streams for stochastic rounding: one helper for the collectives, reducers and hooks.

Every rank must round with its own stream (identical streams would correlate the rounding errors of the
ranks, which unbiasedness over ranks relies on not happening), and a run must be reproducible from a seed.
:func:`rank_generator` gives, per process, one ``torch.Generator`` per (seed, device, rank), seeded with
``seed + rank`` and created on first use on that device.

Sharing: callers that ask for the same seed on the same device in one process get the same generator, so
their draws interleave in one stream (never two copies of one stream, which would correlate them). Give
distinct seeds for independent streams.

Resolution: :func:`rounding_generator` is the one rule for "which stream does stochastic rounding draw
from": the caller's generator when one is given, else this rank's :func:`rank_generator`; the collectives,
their fp32 sums, the reducers and the compressors all ask it. :func:`rank_stream` is the seeding rule itself
(``seed + rank``), which a one-process model of P ranks uses for each simulated rank.

Fork safety: the cache is keyed by the process id. A generator created in a parent process is never
handed to a forked child (which would otherwise draw the parent's numbers, the same in every child); the
child creates and seeds its own.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from mixprec.core.validate import check_group

__all__ = ["DEFAULT_STOCHASTIC_SEED", "rank_generator", "rank_stream", "rounding_generator"]

# Seed of the per-process default generator for rounding="stochastic" (plus the global rank), so runs
# are reproducible when the caller passes no generator.
DEFAULT_STOCHASTIC_SEED = 0x6D697870

# (pid, seed, device, rank) -> generator. A few entries per process (one per seed and device in use).
_GENERATORS: dict[tuple[int, int, torch.device, int], torch.Generator] = {}


def _canonical_device(device: torch.device | str | None) -> torch.device:
    # "cuda" and "cuda:<current>" must map to one generator, not two copies of one stream.
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type != "cpu" and device.index is None:
        module = getattr(torch, device.type, None)
        current = getattr(module, "current_device", None)
        if callable(current):
            device = torch.device(device.type, current())
    return device


def _rank_in(group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("group was given but torch.distributed is not initialised (init_process_group)")
        return 0
    check_group("group", group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return rank


def rank_generator(
    seed: int, device: torch.device | str | None = None, group: dist.ProcessGroup | None = None
) -> torch.Generator:
    """This process's generator for ``seed`` on ``device``, seeded with ``seed + rank``; created on first use.

    Args:
        seed: base seed, an int (``seed + rank`` must lie in torch's seed range, [-2**63, 2**64)).
        device: where the generator draws (a CPU generator for CPU tensors, a CUDA one for CUDA tensors);
            None = CPU. ``"cuda"`` means the current CUDA device.
        group: whose rank is added to the seed: None = the global rank (0 outside a distributed run), a
            process group = the rank within that group (this process must belong to it).

    Returns:
        The same ``torch.Generator`` object on every call with the same seed, device and rank in this
        process (its state advances as it is used; save and restore it with ``get_state``/``set_state``).
        A forked child gets its own, freshly seeded one.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int; got {type(seed).__name__} {seed!r}")
    dev = _canonical_device(device)
    rank = _rank_in(group)
    full_seed = seed + rank
    if not -(2**63) <= full_seed < 2**64:
        raise ValueError(f"seed + rank = {full_seed} is outside torch's seed range [-2**63, 2**64)")
    key = (os.getpid(), seed, dev, rank)
    generator = _GENERATORS.get(key)
    if generator is None:
        if len(_GENERATORS) > 64:
            # Entries of dead parent pids accumulate only across forks; drop them rather than grow.
            pid = os.getpid()
            for stale in [k for k in _GENERATORS if k[0] != pid]:
                del _GENERATORS[stale]
        generator = _GENERATORS[key] = rank_stream(seed, dev, rank)
    return generator


def rank_stream(seed: int, device: torch.device | str | None, rank: int) -> torch.Generator:
    """A fresh generator on ``device`` seeded as :func:`rank_generator` seeds rank ``rank``'s: ``seed + rank``.

    For a model of P ranks in one process (rank r's stream, r < P); a real rank uses :func:`rank_generator`,
    which caches the one object per (seed, device, rank)."""
    generator = torch.Generator(device=torch.device("cpu") if device is None else device)
    generator.manual_seed(seed + rank)
    return generator


def rounding_generator(
    rounding: str,
    generator: torch.Generator | None,
    device: torch.device | str | None,
    seed: int = DEFAULT_STOCHASTIC_SEED,
) -> torch.Generator | None:
    """The stream that rounding ``rounding`` draws from on ``device``.

    ``"stochastic"`` with no ``generator``: this rank's :func:`rank_generator` (``seed``, ``device``), created on
    first use; otherwise ``generator`` itself, as given (None for round to nearest, which draws nothing).
    """
    if rounding != "stochastic" or generator is not None:
        return generator
    return rank_generator(seed, device)
