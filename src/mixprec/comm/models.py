"""One-process models of the collectives, bit for bit: what every rank holds after the real call.

The reducers' :meth:`~mixprec.comm.reducer.GradReducer.model` methods are built from these, and so is
everything that needs a collective's exact result without a process group (the simulated data parallelism
of ``mixprec train --simulate-dp``, the reduction-error study). Inputs are the P ranks' tensors stacked as
``rows`` [P, n], rank r in row r.

* :func:`gloo_ring_sum`: gloo's ring all-reduce (SUM) in the wire dtype, as measured against torch 2.13's
  gloo (``tests/test_reducer_family.py``); the only ring model in mixprec.
* :func:`binary_tree_sum`: a pairwise tree in rank order, rounding at every level: the shape of NCCL's tree
  (not its exact order, which no CPU can measure).
* :func:`fp32_accumulate_rows` / :func:`hierarchical_fp32_rows`: :mod:`mixprec.comm.fp32_accumulate`'s flat
  and two-stage arithmetic (the same :func:`~mixprec.comm.fp32_sum.sum_shards_into` the real ranks call).
* :class:`GroupState`: the state a reducer keeps while it models P ranks (each rank's random stream,
  per-bucket tensors), since one reducer object then stands for the whole group.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.comm.fp32_sum import round_blocks_into, sum_shards_into
from mixprec.comm.topology import Topology
from mixprec.core.dtypes import WIRE_DTYPES, Rounding
from mixprec.core.random import rank_stream
from mixprec.core.validate import check_tensor

__all__ = [
    "GLOO_MAX_SEGMENT_BYTES",
    "GroupState",
    "binary_tree_sum",
    "check_rows",
    "fp32_accumulate_rows",
    "gloo_ring_sum",
    "hierarchical_fp32_rows",
    "ring_chunk",
    "same_on_every_rank",
    "topology_shape",
    "wire_add",
]

GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's allreduce.cc: kMaxSegmentSize


def check_rows(rows: Any, dtypes: tuple[torch.dtype, ...] = WIRE_DTYPES) -> tuple[int, int]:
    """``rows`` is a 2-D tensor [P, n] (P >= 1) of ``dtypes``, rows contiguous; returns (P, n)."""
    check_tensor("rows", rows, dtypes)
    if rows.dim() != 2 or rows.shape[0] < 1:
        raise ValueError(f"rows must be [P, n] with P >= 1 (rank r's bucket in row r); got shape {tuple(rows.shape)}")
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise ValueError(f"each row of rows must be contiguous; got strides {rows.stride()}")
    return rows.shape[0], rows.shape[1]


def same_on_every_rank(result: torch.Tensor, world: int) -> torch.Tensor:
    """[P, n]: the one result every rank holds, as a broadcast (read-only) view of ``result`` [n]."""
    return result.view(1, -1).expand(world, -1)


def topology_shape(topology: Any) -> tuple[int, int]:
    """(nodes, ranks_per_node) of a :class:`Topology` or a 2-D DeviceMesh ("node", "local")."""
    if isinstance(topology, Topology):
        return topology.nodes, topology.ranks_per_node
    nodes, per_node = (int(s) for s in topology.mesh.shape)
    return nodes, per_node


def wire_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One hop of a backend's SUM in the wire dtype: the exact fp32 sum of two fp16/bf16 values, one rounding."""
    if a.dtype in (torch.float32, torch.float64):
        return a + b
    return (a.float() + b.float()).to(a.dtype)


def ring_chunk(numel: int, world: int, itemsize: int) -> int:
    """Elements per chunk of gloo's ring: S / P segments of ceil(numel / S) elements, where the segment count
    S = roundUp(max(ceil(bytes / 1 MiB), 2P), P) (gloo caps a segment at 1 MiB)."""
    max_bytes = itemsize * max(1, GLOO_MAX_SEGMENT_BYTES // itemsize)
    segments = max(-(-numel * itemsize // max_bytes), 2 * world)
    segments = -(-segments // world) * world
    return segments // world * -(-numel // segments)


def gloo_ring_sum(rows: torch.Tensor, *, pre_divide: int | None = None) -> torch.Tensor:
    """gloo's ring all-reduce (SUM) of ``rows[r]`` = rank r's tensor, bit for bit, in the rows' dtype; [n].

    gloo cuts the n elements into S segments of ceil(n / S) elements (S: :func:`ring_chunk`), S / P consecutive
    ones per rank; chunk c starts at rank c-1 and travels down the ring, each rank adding its own value and
    rounding: ``((x[c-1] + x[c-2]) + ...) + x[c]`` (indices mod P). Measured against torch 2.13's gloo for
    P = 2-4 (fp16, bf16, fp32, fp64; above 2P MiB too), see docs/lab.md. ``pre_divide``: each rank's values
    are first divided by it in their dtype (torch DDP's pre-divide), element by element as they are read, so
    no divided copy of ``rows`` is made. Work: P - 1 gathers of n elements; memory: a few times n.
    """
    world, n = rows.shape
    chunk = ring_chunk(n, world, rows.element_size())
    full = n // chunk  # whole chunks; then at most one partial chunk, and empty ones (nothing to add)
    out = rows.new_empty(n)
    pieces = [(rows[:, : full * chunk].reshape(world, full, chunk), 0, full)] if full else []
    if full * chunk < n:
        pieces.append((rows[:, full * chunk :].reshape(world, 1, n - full * chunk), full, full + 1))
    for v, first, stop in pieces:
        c = torch.arange(first, stop)
        cols = torch.arange(stop - first)

        def hop(m: int, v: torch.Tensor = v, c: torch.Tensor = c, cols: torch.Tensor = cols) -> torch.Tensor:
            x = v[(c - m) % world, cols]  # chunk c's value on rank c - m
            return torch.div(x, pre_divide) if pre_divide is not None else x

        acc = hop(1)
        for m in range(2, world + 1):
            acc = wire_add(acc, hop(m))
        out[first * chunk : min(stop * chunk, n)] = acc.reshape(-1)
    return out


def binary_tree_sum(rows: torch.Tensor) -> torch.Tensor:
    """A binary-tree SUM in rank order, rounding after every addition: pairs (0,1), (2,3), ..., then pairs of
    pairs; an odd last row waits a level. The shape of NCCL's tree, not its exact order."""
    t = rows
    while t.shape[0] > 1:
        k = t.shape[0] // 2
        t = torch.cat([wire_add(t[0 : 2 * k : 2], t[1 : 2 * k : 2]), t[2 * k :]])
    return t[0]


def fp32_accumulate_rows(
    rows: torch.Tensor,
    *,
    average: bool,
    rounding: Rounding = "nearest",
    generators: list[torch.Generator] | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`mixprec.comm.all_reduce_fp32_accumulate` of ``rows`` [P, n] (n a multiple of P): [n] in
    ``out_dtype`` (default the rows'), fp32 sum in rank order (/ P), one rounding.

    The fp32 sums are one pass over the whole tensor (each element's arithmetic is independent of who owns
    it). Stochastic rounding then rounds owner p's shard ``[p S, (p+1) S)`` with ``generators[p]`` (rank p's
    stream) in the blocks the real rank rounds, so the draws are the real ones.
    """
    world, n = rows.shape
    out = torch.empty(n, dtype=out_dtype or rows.dtype, device=rows.device)
    if rounding == "nearest" or out.dtype == torch.float32:
        sum_shards_into(out, rows, average=average, rounding="nearest", generator=None)
        return out
    if generators is None or len(generators) != world:
        raise RuntimeError("internal error: stochastic rounding needs one generator per rank")
    sums = torch.empty(n, dtype=torch.float32, device=rows.device)
    sum_shards_into(sums, rows, average=average, rounding="nearest", generator=None)
    shard = n // world
    for p in range(world):
        part = slice(p * shard, (p + 1) * shard)
        round_blocks_into(out[part], sums[part], rounding=rounding, generator=generators[p])
    return out


def hierarchical_fp32_rows(
    rows: torch.Tensor, ranks_per_node: int, *, average: bool, inter_dtype: torch.dtype | None
) -> torch.Tensor:
    """:mod:`mixprec.comm.hierarchical_fp32`'s all-reduce (round to nearest) of ``rows`` [P, n]: [n].

    Ranks numbered node-major. Each node sums its ranks in fp32 in local-rank order (/ n), rounds the partial
    to ``inter_dtype`` (None: the rows' dtype; fp32: no rounding); the partials are summed in node order
    (/ m) and rounded once more. Element by element, whoever owns the element.
    """
    world, n = rows.shape
    nodes = world // ranks_per_node
    partials = torch.empty(nodes, n, dtype=inter_dtype or rows.dtype, device=rows.device)
    for node in range(nodes):
        sum_shards_into(
            partials[node],
            rows[node * ranks_per_node : (node + 1) * ranks_per_node],
            average=average,
            rounding="nearest",
            generator=None,
        )
    out = torch.empty(n, dtype=rows.dtype, device=rows.device)
    sum_shards_into(out, partials, average=average, rounding="nearest", generator=None)
    return out


class GroupState:
    """What a reducer keeps while its :meth:`model` stands for a group of P ranks in one process.

    A reducer of a real run keeps one rank's state; modelling, the one object holds every simulated rank's:
    rank r's random stream (a ``torch.Generator`` seeded ``seed + r``, as
    :func:`mixprec.comm.rank_generator` seeds rank r's) and, per bucket key, named tensors with one row (or
    one part) per rank, e.g. error-feedback residuals. Created empty; sized by the first call, after which
    the group size is fixed (a model of another P gets a fresh reducer). ``state_dict`` holds plain tensors.
    """

    def __init__(self) -> None:
        self.world: int | None = None
        self.generators: list[torch.Generator] | None = None
        self.tensors: dict[int, dict[str, torch.Tensor]] = {}
        self._loaded_streams: list[torch.Tensor] | None = None

    def check_world(self, world: int) -> None:
        """Fix the group size at the first call; ValueError when a later call models another one."""
        if self.world is None:
            self.world = world
        elif world != self.world:
            raise ValueError(
                f"rows has {world} rows but this reducer models a group of {self.world} ranks (its per-rank state "
                "is sized for them): use a fresh reducer for another group size"
            )

    def streams(self, seed: int, device: torch.device) -> list[torch.Generator]:
        """Rank r's stream for r < P, created on first use (seeded ``seed + r``, or a loaded state)."""
        if self.world is None:
            raise RuntimeError("internal error: streams asked before the group size is known")
        if self.generators is None:
            gens = [rank_stream(seed, device, r) for r in range(self.world)]
            if self._loaded_streams is not None:
                if len(self._loaded_streams) != self.world:
                    raise ValueError(
                        f"the loaded model state holds {len(self._loaded_streams)} random streams; the group has "
                        f"{self.world} ranks"
                    )
                for g, st in zip(gens, self._loaded_streams, strict=True):
                    g.set_state(st)
                self._loaded_streams = None
            self.generators = gens
        return self.generators

    def tensor(self, key: int, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Bucket ``key``'s fp32 tensor ``name``, zeros at first; ValueError when its shape changed."""
        entry = self.tensors.setdefault(key, {})
        t = entry.get(name)
        if t is None:
            t = entry[name] = torch.zeros(shape, dtype=torch.float32, device=device)
        elif tuple(t.shape) != tuple(shape):
            raise ValueError(
                f"bucket key {key} held a {name} state of shape {tuple(t.shape)}; this call needs {tuple(shape)} "
                "(one key per bucket: the same length at every call)"
            )
        return t

    def state_dict(self) -> dict[str, Any]:
        """``{"world": P, "generators": [P uint8 states] (if any), "tensors": {key: {name: tensor}}}``."""
        state: dict[str, Any] = {"world": self.world}
        streams = [g.get_state() for g in self.generators] if self.generators is not None else self._loaded_streams
        if streams is not None:
            state["generators"] = [s.clone() for s in streams]
        state["tensors"] = {k: {n: t.clone() for n, t in v.items()} for k, v in self.tensors.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked before anything changes)."""
        if not isinstance(state, dict):
            raise TypeError(f"model state must be a dict; got {type(state).__name__}")
        world = state.get("world")
        if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            raise ValueError(f"model state['world'] must be an int >= 1 or None; got {world!r}")
        streams = state.get("generators")
        if streams is not None:
            if not isinstance(streams, list) or not all(
                isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1 for s in streams
            ):
                raise TypeError("model state['generators'] must be a list of 1-D uint8 tensors (Generator states)")
            if world is not None and len(streams) != world:
                raise ValueError(f"model state holds {len(streams)} random streams for a group of {world} ranks")
        tensors = state.get("tensors", {})
        if not isinstance(tensors, dict) or not all(
            isinstance(k, int) and isinstance(v, dict) and all(isinstance(t, torch.Tensor) for t in v.values())
            for k, v in tensors.items()
        ):
            raise TypeError("model state['tensors'] must map bucket keys to dicts of tensors")
        self.world = world
        self.generators = None
        self._loaded_streams = None if streams is None else [s.clone() for s in streams]
        self.tensors = {k: {n: t.clone() for n, t in v.items()} for k, v in tensors.items()}
