"""Simulated data parallelism: P ranks' gradients computed in one process, reduced by a bit-exact model.

``parallel.simulate_dp = P`` runs each simulated rank's microbatches through the one model in turn (the
same batches, loss division and loss scale as rank r of a real ``--nproc P`` run, at one thread as the real
ranks run), lays each rank's gradients out as mixprec's DistributedDataParallel buckets them, and reduces
them with a model of ``parallel.reduce`` that rounds exactly where the real collective rounds:

* ``fp32_accumulate``: widen, add in fp32 in rank order, divide by P, one rounding (``mixprec.comm``);
  ``fp32_accumulate_hierarchical``: the same inside each node (divide by its n ranks), the node partial rounded
  to the wire dtype, then across nodes in node order (divide by m), one more rounding;
* ``native``: each rank pre-divides by P in the wire dtype, then gloo's ring (every hop rounds to the wire
  dtype, chunk c summed from rank c-1 downwards) or a binary tree (``simulate_algorithm``);
* ``uint8``: the flat ByteGrad pipeline with ``MinMaxUInt8.encode_rows`` / ``decode_rows``;
  ``uint8_hierarchical``: an fp32 sum inside each node, then that pipeline between nodes; both with or without
  error feedback (each rank's and each owner's residual, carried from step to step and checkpointed), rounding
  to nearest or stochastically (each rank's generator, seeded as ``mixprec.comm.rank_generator`` seeds the
  real rank's, draws one Philox key per bucket and step; the stream positions are the real pipeline's).

The logged loss is summed over the ranks in fp64 by the same ring model (gloo's order), so a simulated run's
``metrics.jsonl`` equals the real run's bit for bit. Memory and speed, the measured gloo algorithm and what is
not modelled: docs/lab.md ("Simulated data parallelism").
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any

import torch

from mixprec.compress import MinMaxUInt8, Uint8Options
from mixprec.core.philox import draw_key
from mixprec.lab.build import Parts, autocast
from mixprec.lab.config import TrainConfig
from mixprec.lab.corpus import Corpus
from mixprec.lab.data import dropout_seed, eval_chunks, train_microbatches
from mixprec.lab.telemetry import HeadroomProbe
from mixprec.parallel import DistributedDataParallel
from mixprec.parallel.buckets import build_layout
from mixprec.scaling import Updater, UpdateResult

__all__ = ["SimulatedRanks", "fp32_accumulate_sum", "gloo_ring_sum", "tree_sum", "uint8_flat_sum"]

# The wrapper's default bucket size: the simulated buckets (and so the ring's chunks) must be the real ones.
_BUCKET_SIZE: int = inspect.signature(DistributedDataParallel).parameters["bucket_size"].default
_UINT8_CHUNK: int = inspect.signature(MinMaxUInt8).parameters["chunk_size"].default
# The real reducer's stochastic stream: rank_generator(seed, device) seeded with seed + global rank.
_UINT8_SEED: int = Uint8Options().seed


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One hop of a backend's SUM in the wire dtype: exact fp32 sum of two fp16/bf16 values, one rounding."""
    if a.dtype in (torch.float32, torch.float64):
        return a + b
    return (a.float() + b.float()).to(a.dtype)


_GLOO_MAX_SEGMENT_BYTES = 1 << 20  # gloo's allreduce.cc: kMaxSegmentSize


def ring_chunk(numel: int, world: int, itemsize: int) -> int:
    """Elements per chunk of gloo's ring: S / P segments of ceil(numel / S) elements, where the segment count
    S = roundUp(max(ceil(bytes / 1 MiB), 2P), P) (gloo caps a segment at 1 MiB)."""
    max_bytes = itemsize * max(1, _GLOO_MAX_SEGMENT_BYTES // itemsize)
    segments = max(-(-numel * itemsize // max_bytes), 2 * world)
    segments = -(-segments // world) * world
    return segments // world * -(-numel // segments)


def gloo_ring_sum(rows: torch.Tensor) -> torch.Tensor:
    """gloo's ring all-reduce (SUM) of ``rows[r]`` = rank r's tensor, bit for bit, in the rows' dtype.

    gloo cuts the n elements into S segments of ceil(n / S) elements (S: :func:`ring_chunk`), S / P consecutive
    ones per rank; chunk c starts at rank c-1 and travels down the ring, each rank adding its own value and rounding:
    ``((x[c-1] + x[c-2]) + ...) + x[c]`` (indices mod P). Measured against torch 2.13's gloo for P = 2-4.
    """
    world, n = rows.shape
    padded = rows.new_zeros(world, world * ring_chunk(n, world, rows.element_size()))
    padded[:, :n] = rows
    return _ring_sum_padded(padded, n)


def _ring_sum_padded(padded: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`gloo_ring_sum` of rows already padded to P chunks (the simulator stores them so: no copy)."""
    world = padded.shape[0]
    v = padded.view(world, world, -1)
    c = torch.arange(world)
    acc = v[(c - 1) % world, c]
    for m in range(2, world + 1):
        acc = _add(acc, v[(c - m) % world, c])
    return acc.reshape(-1)[:n]


def tree_sum(rows: torch.Tensor) -> torch.Tensor:
    """A binary-tree SUM in rank order, rounding after every addition: pairs (0,1), (2,3), ..., then pairs of
    pairs; an odd last row waits a level. The shape of NCCL's tree, not its exact order."""
    t = rows
    while t.shape[0] > 1:
        k = t.shape[0] // 2
        t = torch.cat([_add(t[0 : 2 * k : 2], t[1 : 2 * k : 2]), t[2 * k :]])
    return t[0]


class _Feedback:
    """One bucket's error-feedback residuals for every simulated rank at once (each rank's ErrorFeedback): the
    worker residual of each sender (a rank's input, or in hierarchical mode its node slice) and the server
    residual of each owner (owner p's part is ``server.view(P, -1)[p]``). Zeros at first, as the real ones."""

    def __init__(self, world: int, sender_numel: int, numel: int) -> None:
        self.worker = torch.zeros(world, sender_numel)
        self.server = torch.zeros(numel)

    def reset(self) -> None:
        """What the real collective does on every rank when its result holds flagged (NaN/Inf) chunks."""
        self.worker.zero_()
        self.server.zero_()


class _Reduction:
    """One bucket's reduction over the simulated ranks, fed one rank's bucket at a time in rank order.

    The uint8 kinds: a *sender* quantizes R rows of ``part`` elements (flat: a rank's bucket, R = P;
    hierarchical: local rank l's slice of its node's fp32 sum, R = nodes), adding its worker residual first
    under error feedback; each *owner* p sums the decoded row p of every sender in fp32, in sender order.
    """

    def __init__(
        self,
        reduce: str,
        algorithm: str,
        world: int,
        numel: int,
        dtype: torch.dtype,
        *,
        per_node: int = 1,
        feedback: _Feedback | None = None,
        keys: list[int] | None = None,
    ) -> None:
        self.reduce, self.algorithm, self.world, self.numel, self.dtype = reduce, algorithm, world, numel, dtype
        self.rank = 0
        self.feedback = feedback
        if reduce == "native":
            width = world * ring_chunk(numel, world, dtype.itemsize) if algorithm == "ring" else numel
            self.rows = torch.zeros(world, width, dtype=dtype)
        else:
            self.acc = torch.empty(numel, dtype=torch.float32)
        if reduce == "fp32_accumulate_hierarchical":
            self.per_node = per_node
            self.nodes = world // per_node
            self.node_sum = torch.empty(numel, dtype=torch.float32)
        if reduce.startswith("uint8"):
            # keys: each rank's Philox key for this call (stochastic rounding), None for round to nearest
            self.keys = keys
            self.comp = MinMaxUInt8(chunk_size=_UINT8_CHUNK, rounding="nearest" if keys is None else "stochastic")
            self.part = numel // world
            nbytes = self.comp.encoded_nbytes(self.part)
            self.per_node = per_node if reduce == "uint8_hierarchical" else world
            self.nodes = world // self.per_node
            self.sender_rows = self.nodes if reduce == "uint8_hierarchical" else world
            self.codes = torch.empty(world, nbytes, dtype=torch.uint8)
            self.decoded = torch.empty(numel, dtype=torch.float32)
            if reduce == "uint8_hierarchical":
                self.node_sum = torch.empty(numel, dtype=torch.float32)

    def add(self, bucket: torch.Tensor) -> None:
        if self.reduce == "native":
            torch.div(bucket, self.world, out=self.rows[self.rank, : self.numel])  # the pre-divide, wire dtype
        elif self.reduce == "fp32_accumulate":
            if self.rank == 0:
                self.acc.copy_(bucket)  # exact widening
            else:
                self.acc.add_(bucket.float())
        elif self.reduce == "fp32_accumulate_hierarchical":
            # mixprec.comm.hierarchical_fp32: stage 1 sums the node's ranks in local-rank order and divides by n,
            # the partial is rounded to the wire dtype (what crosses nodes); stage 2 sums the partials in node
            # order and divides by m. Element by element, whatever rank owns the element.
            node, local = divmod(self.rank, self.per_node)
            if local == 0:
                self.node_sum.copy_(bucket)  # exact widening
            else:
                self.node_sum.add_(bucket.float())
            if local == self.per_node - 1:
                partial = self.node_sum.div_(self.per_node).to(self.dtype)
                if node == 0:
                    self.acc.copy_(partial)
                else:
                    self.acc.add_(partial.float())
        elif self.reduce == "uint8":
            # Rank r quantizes its W parts; owner p decodes part p of every rank and sums them in fp32 in rank
            # order: the same additions, one rank at a time.
            self._send(self.rank, bucket.view(self.world, self.part), slice(0, self.world), first=self.rank == 0)
        else:
            # Intra-node reduce-scatter in fp32 (local-rank order), then local rank l of node i sends slice l
            # ([nodes, part]: one row per inter-node owner) once its node's sum is complete.
            node, local = divmod(self.rank, self.per_node)
            if local == 0:
                self.node_sum.copy_(bucket)  # exact widening
            else:
                self.node_sum.add_(bucket.float())
            if local == self.per_node - 1:
                slices = self.node_sum.view(self.per_node, self.nodes, self.part)
                for lr in range(self.per_node):
                    rows = slice(lr * self.nodes, (lr + 1) * self.nodes)  # owners (node j, local lr): row lr m + j
                    self._send(node * self.per_node + lr, slices[lr], rows, first=node == 0)
        self.rank += 1

    def _send(self, sender: int, x: torch.Tensor, owners: slice, *, first: bool) -> None:
        """Sender ``sender`` quantizes ``x`` [R, part] (plus its residual); the owners ``owners`` add its rows."""
        rows = x.shape[0]
        codes = self.codes[:rows]
        residual = None
        if self.feedback is not None:
            residual = self.feedback.worker[sender].view(rows, self.part)
            x = x.float() + residual  # torch.add(input, residual, out=fp32 staging): exact widening, one rounding
        if self.keys is None:
            bad = self.comp.encode_rows(x, codes)
        else:  # the sender's stream, row r at position r * part: what FlatPhase's first encode takes
            bad = self.comp.encode_rows(x, codes, key=self.keys[sender], offset=0, row_stride=self.part)
        if residual is not None and not bad:
            self.comp.decode_rows(codes, self.part, residual)
            torch.sub(x, residual, out=residual)  # what this quantization lost
        target = self.acc.view(self.world, self.part)[owners]
        if first:
            self.comp.decode_rows(codes, self.part, target)
        else:
            decoded = self.decoded.view(self.world, self.part)[:rows]
            self.comp.decode_rows(codes, self.part, decoded)
            target.add_(decoded)

    def _reencode(self, row: int, x: torch.Tensor, codes: torch.Tensor) -> int:
        """Owner of result row ``row`` re-quantizes its part: with stochastic rounding, from its own key at the
        positions after its sent ones (FlatPhase: ``numel + a``, numel = senders' rows x part)."""
        if self.keys is None:
            return self.comp.encode_rows(x, codes)
        if self.reduce == "uint8_hierarchical":  # row l m + j is owned by local rank l of node j
            local, node = divmod(row, self.nodes)
            owner = node * self.per_node + local
        else:
            owner = row
        return self.comp.encode_rows(x, codes, key=self.keys[owner], offset=self.sender_rows * self.part)

    def result(self) -> torch.Tensor:
        """The averaged bucket every rank holds after the collective."""
        if self.rank != self.world:
            raise RuntimeError(f"internal error: {self.rank} of {self.world} ranks reduced")
        if self.reduce == "native":
            if self.algorithm == "ring":
                return _ring_sum_padded(self.rows, self.numel)
            return tree_sum(self.rows)
        if self.reduce == "fp32_accumulate_hierarchical":
            return self.acc.div_(self.nodes).to(self.dtype)
        self.acc.div_(self.world)
        if self.reduce == "fp32_accumulate":
            return self.acc.to(self.dtype)
        out = torch.empty(self.numel, dtype=self.dtype)
        owned = self.acc.view(self.world, self.part)
        if self.feedback is None and self.keys is None:
            self.comp.encode_rows(owned, self.codes)  # each owner re-quantizes its part
        else:
            server = self.feedback.server.view(self.world, self.part) if self.feedback is not None else None
            if server is not None:
                owned.add_(server)
            for p in range(self.world):  # an owner's residual is kept only when its own part was finite
                bad = self._reencode(p, owned[p : p + 1], self.codes[p : p + 1])
                if server is not None and not bad:
                    self.comp.decode_rows(self.codes[p : p + 1], self.part, server[p : p + 1])
                    torch.sub(owned[p : p + 1], server[p : p + 1], out=server[p : p + 1])
        self.comp.decode_rows(self.codes, self.part, out.view(self.world, self.part))
        if self.feedback is not None and not bool(torch.isfinite(out).all()):
            self.feedback.reset()  # flagged chunks in the result: every rank clears the bucket's residuals
        return out


def fp32_accumulate_sum(rows: torch.Tensor) -> torch.Tensor:
    """mixprec's fp32-accumulating all-reduce (average) of ``rows[r]`` = rank r's tensor."""
    return _reduce_rows("fp32_accumulate", rows)


def uint8_flat_sum(rows: torch.Tensor) -> torch.Tensor:
    """mixprec's flat uint8 all-reduce (average, nearest rounding, no error feedback) of ``rows``."""
    return _reduce_rows("uint8", rows)


def _reduce_rows(reduce: str, rows: torch.Tensor) -> torch.Tensor:
    red = _Reduction(reduce, "ring", rows.shape[0], rows.shape[1], rows.dtype)
    for row in rows:
        red.add(row)
    return red.result()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread, as every --nproc rank runs (CPU kernels are bit-reproducible per thread count);
    the caller's setting is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SimulatedRanks:
    """Trains ``parts`` as ``cfg.parallel.simulate_dp`` data-parallel ranks would (see the module docstring).

    ``step(step)`` returns the UpdateResult a real rank's Updater returns, its ``loss`` the mean over the ranks
    as the real run logs it; ``evaluate()`` is the real run's validation loss.
    """

    def __init__(
        self, parts: Parts, cfg: TrainConfig, corpus: Corpus, device: torch.device, *, shadow: str | None = None
    ) -> None:
        if device.type != "cpu":
            raise ValueError(f"simulate_dp runs on the CPU (the models are bit-exact there); device is {device}")
        self.cfg, self.corpus, self.device, self.module = cfg, corpus, device, parts.module
        self.world = cfg.parallel.simulate_dp
        self.scaler = parts.scaler
        named = [(name, p) for name, p in parts.module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.layout = build_layout(named, world_size=self.world, bucket_size=_BUCKET_SIZE, grad_dtype=None)
        base = parts.updater
        self.loss_fn = base.loss_fn
        self.updater = Updater(
            parts.module,
            parts.optimizer,
            base.loss_fn,
            scaler=parts.scaler,
            num_microbatches=base.num_microbatches,
            grad_reduce=self._publish,
            clip_grad_norm=base.clip_grad_norm,
        )
        self._reduced: list[torch.Tensor] = []
        self._probe: HeadroomProbe | None = None
        p = cfg.parallel
        self.per_node = p.ranks_per_node if p.reduce.endswith("_hierarchical") else 1
        if p.reduce.endswith("_hierarchical") and (not self.per_node or self.world % self.per_node):
            raise RuntimeError("internal error: ranks_per_node must be resolved (and divide the ranks) before training")
        self.feedback: list[_Feedback] | None = None
        if p.error_feedback:
            sender = self.world // self.per_node if p.reduce.endswith("_hierarchical") else self.world
            self.feedback = [
                _Feedback(self.world, sender * (b.numel // self.world), b.numel) for b in self.layout.buckets
            ]
        # Stochastic rounding: rank r's stream, seeded as the real rank's reducer seeds it.
        self.generators: list[torch.Generator] | None = None
        if p.rounding == "stochastic":
            self.generators = [torch.Generator().manual_seed(_UINT8_SEED + r) for r in range(self.world)]
        # A second reduction of the same per-rank buckets, for studies: the step uses ``reduce``; after it,
        # ``reduced`` and ``shadow_reduced`` hold both results (mixprec.lab.uint8_study).
        self.shadow = shadow
        self.reduced: list[torch.Tensor] = []
        self.shadow_reduced: list[torch.Tensor] = []

    def _microbatches(self, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        d, t = self.cfg.data, self.cfg.training
        return train_microbatches(
            self.corpus.train,
            seed=t.seed,
            step=step,
            global_batch_size=d.global_batch_size,
            micro_batch_size=d.micro_batch_size,
            block_size=self.cfg.model.block_size,
            rank=rank,
            world_size=self.world,
        )

    def _local_gradient(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One rank's accumulated gradient in ``param.grad`` and its mean loss, as Updater.step computes them."""
        for p in self.params:
            p.grad = None
        n = len(microbatches)
        total: torch.Tensor | None = None
        for x, y in microbatches:
            loss = self.loss_fn(self.module, (x.to(self.device), y.to(self.device)))
            self.scaler.scale(loss.float() / n).backward()
            term = loss.detach().reshape(()).double()
            total = term if total is None else total + term
        return float(total) / n if total is not None else 0.0

    def _bucket(self, k: int) -> torch.Tensor:
        """This rank's bucket k as the wrapper lays it out (reversed parameter order, zero padding)."""
        b = self.layout.buckets[k]
        dtype = self.layout.groups[b.group][1]
        out = torch.zeros(b.numel, dtype=dtype)
        for slot in b.slots:
            grad = self.params[slot.index].grad
            if grad is not None:
                out[slot.start : slot.start + slot.numel] = grad.reshape(-1)
        return out

    def _reductions(self, reduce: str, *, feedback: bool = False) -> list[_Reduction]:
        """One reduction of ``reduce`` per bucket, in bucket order (the run's own: with its residuals and, for
        stochastic rounding, one key per rank drawn from each rank's stream, bucket by bucket, when ``feedback``)."""
        gens = self.generators if feedback else None
        return [
            _Reduction(
                reduce,
                self.cfg.parallel.simulate_algorithm,
                self.world,
                b.numel,
                self.layout.groups[b.group][1],
                per_node=self.per_node,
                feedback=self.feedback[k] if feedback and self.feedback is not None else None,
                keys=[draw_key(g) for g in gens] if gens is not None else None,
            )
            for k, b in enumerate(self.layout.buckets)
        ]

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold beyond the model, optimizer and scaler: the error-feedback residuals and
        the ranks' stochastic-rounding streams."""
        state: dict[str, Any] = {}
        if self.feedback is not None:
            state["feedback"] = [{"worker": f.worker.clone(), "server": f.server.clone()} for f in self.feedback]
        if self.generators is not None:
            state["generators"] = [g.get_state() for g in self.generators]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the configuration was checked against the checkpoint's already)."""
        if self.generators is not None:
            streams = state.get("generators")
            if streams is None or len(streams) != len(self.generators):
                raise ValueError("the checkpoint holds no stochastic-rounding streams for this simulated run")
            for g, st in zip(self.generators, streams, strict=True):
                g.set_state(st)
        if self.feedback is None:
            return
        saved = state.get("feedback")
        if saved is None or len(saved) != len(self.feedback):
            raise ValueError("the checkpoint holds no error-feedback residuals for this simulated run")
        for f, st in zip(self.feedback, saved, strict=True):
            f.worker.copy_(st["worker"])
            f.server.copy_(st["server"])

    def unpack(self, buckets: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per parameter (in ``module.parameters()`` order), its slice of reduced ``buckets``, as a view."""
        out: list[torch.Tensor | None] = [None] * len(self.params)
        for b, reduced in zip(self.layout.buckets, buckets, strict=True):
            for slot in b.slots:
                out[slot.index] = reduced[slot.start : slot.start + slot.numel].view(slot.shape)
        if any(t is None for t in out):
            raise RuntimeError("internal error: a parameter is in no bucket")
        return out  # type: ignore[return-value]

    def step(self, step: int, headroom: HeadroomProbe | None = None) -> UpdateResult:
        """One training step of all the simulated ranks; ``headroom`` captures the reduced gradients when due, as
        a real run's rank 0 does after the wrapper's reduction."""
        if headroom is not None:
            headroom.captured = None
        self._probe = headroom if headroom is not None and headroom.due(step) else None
        try:
            with _one_thread():
                return self._step(step)
        finally:
            self._probe = None

    def _step(self, step: int) -> UpdateResult:
        cfg = self.cfg
        reductions = self._reductions(cfg.parallel.reduce, feedback=True)
        shadows = self._reductions(self.shadow) if self.shadow else []
        losses = torch.empty(self.world, 1, dtype=torch.float64)
        for rank in range(self.world):
            if cfg.model.dropout:
                torch.manual_seed(dropout_seed(cfg.training.seed, step, rank))
            losses[rank, 0] = self._local_gradient(self._microbatches(step, rank))
            for k, red in enumerate(reductions):
                bucket = self._bucket(k)
                red.add(bucket)
                if shadows:
                    shadows[k].add(bucket)
        self._reduced = [red.result() for red in reductions]
        self.reduced = list(self._reduced) if shadows else []
        self.shadow_reduced = [red.result() for red in shadows]
        del reductions, shadows
        # The Updater recomputes rank 0's gradient (1/P of the work) and then takes the reduced one from
        # _publish: its unscale, overflow check, clipping and step are the real ranks' code.
        if cfg.model.dropout:
            torch.manual_seed(dropout_seed(cfg.training.seed, step, 0))
        microbatches = [(x.to(self.device), y.to(self.device)) for x, y in self._microbatches(step, 0)]
        result = self.updater.step(microbatches)
        self._reduced = []
        return dataclasses.replace(result, loss=float(gloo_ring_sum(losses)[0]) / self.world)

    @torch.no_grad()
    def _publish(self, grads: list[torch.Tensor]) -> None:
        """Updater's grad_reduce: every parameter's gradient becomes its slice of the reduced buckets."""
        for b, reduced in zip(self.layout.buckets, self._reduced, strict=True):
            for slot in b.slots:
                p = self.params[slot.index]
                value = reduced[slot.start : slot.start + slot.numel].view(slot.shape).to(p.dtype)
                if p.grad is None:
                    p.grad = value.clone()
                else:
                    p.grad.copy_(value)
        if self._probe is not None:
            self._probe.capture()

    def evaluate(self) -> float:
        """The validation loss a real P-rank run logs: each rank's (loss sum, count) in fp64, summed by gloo's
        ring in fp64 (as ``mixprec.lab.train.evaluate`` does with all_reduce_sum_fp64)."""
        with _one_thread():
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> float:
        cfg, module = self.cfg, self.module
        context = autocast(cfg, self.device)
        was_training = module.training
        module.eval()
        sums = torch.zeros(self.world, 2, dtype=torch.float64)
        for rank in range(self.world):
            total, count = 0.0, 0.0
            chunks = eval_chunks(
                self.corpus.val,
                seed=cfg.training.seed,
                eval_sequences=cfg.data.eval_sequences,
                micro_batch_size=cfg.data.micro_batch_size,
                block_size=cfg.model.block_size,
                rank=rank,
                world_size=self.world,
            )
            for x, y in chunks:
                with context():
                    _, loss = module(x.to(self.device), y.to(self.device))
                total += float(loss) * x.shape[0]
                count += x.shape[0]
            sums[rank, 0], sums[rank, 1] = total, count
        module.train(was_training)
        total, count = gloo_ring_sum(sums).tolist()
        return total / count

    def describe(self) -> str:
        p = self.cfg.parallel
        model = f"{p.reduce} ({p.simulate_algorithm})" if p.reduce == "native" else p.reduce
        return f"simulating {self.world} data-parallel ranks in this process, reduction model {model}"
