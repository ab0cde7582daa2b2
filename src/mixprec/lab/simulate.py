"""Simulated data parallelism: P ranks' gradients computed in one process, reduced by the reducer's own model.

``parallel.simulate_dp = P`` runs each simulated rank's microbatches through the one model in turn (the
same batches, loss division and loss scale as rank r of a real ``--parallel.nproc P`` run, at one thread as the real
ranks run), lays each rank's gradients out as mixprec's DistributedDataParallel buckets them, and hands the
P buckets of each bucket to the reducer a real run builds (``make_reducer(parallel.reduce, ...)``, same
options and topology), through its :meth:`~mixprec.comm.GradReducer.model`: the bit-exact one-process model
of its ``all_reduce``, which keeps the simulated ranks' error-feedback residuals and random streams itself.
Nothing here knows how any reducer works: a new reducer is simulated once it models itself.

The logged loss is summed over the ranks in fp64 by gloo's ring model (:func:`mixprec.comm.models.gloo_ring_sum`),
so a simulated run's ``metrics.jsonl`` equals the real run's bit for bit. Memory and speed, the measured gloo
algorithm and what is not modelled: docs/lab.md ("Simulated data parallelism").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from mixprec.comm import make_reducer
from mixprec.comm.models import gloo_ring_sum
from mixprec.lab.build import Parts, autocast, reducer_options, seed_step
from mixprec.lab.config import TrainConfig
from mixprec.lab.corpus import Corpus
from mixprec.lab.data import eval_chunks, train_microbatches
from mixprec.lab.telemetry import HeadroomProbe
from mixprec.parallel.buckets import DEFAULT_BUCKET_SIZE, build_layout
from mixprec.scaling import Updater, UpdateResult

__all__ = ["SimulatedRanks"]


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread, as every --parallel.nproc rank runs (CPU kernels are bit-reproducible per thread count);
    the caller's setting is restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SimulatedRanks:
    """Trains ``parts`` as ``cfg.parallel.simulate_dp`` data-parallel ranks would (see the module docstring): the
    training loop's stepper (:class:`mixprec.lab.train.Stepper`) for a simulated run, in place of a real rank's.

    ``step(step)`` returns the UpdateResult a real rank's Updater returns, its ``loss`` the mean over the ranks
    as the real run logs it; ``evaluate()`` is the real run's validation loss.
    """

    def __init__(
        self, parts: Parts, cfg: TrainConfig, corpus: Corpus, device: torch.device, *, shadow: str | None = None
    ) -> None:
        if device.type != "cpu":
            raise ValueError(f"simulate_dp runs on the CPU (the models are bit-exact there); device is {device}")
        self.cfg, self.corpus, self.device, self.module = cfg, corpus, device, parts.module
        self.parts = parts
        self.world = cfg.parallel.simulate_dp
        self.scaler = parts.scaler
        named = [(name, p) for name, p in parts.module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.layout = build_layout(named, world_size=self.world, bucket_size=DEFAULT_BUCKET_SIZE, grad_dtype=None)
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
        # The reducer a real run builds, standing for all P ranks (their residuals and streams in its model_state).
        self.reducer = make_reducer(cfg.parallel.reduce, **reducer_options(cfg, self.world))
        # A second reduction of the same per-rank buckets, for studies: the step uses ``reduce``; after it,
        # ``reduced`` and ``shadow_reduced`` hold both results (mixprec.lab.studies.uint8_study). Default options.
        self.shadow = shadow
        self.shadow_reducer = make_reducer(shadow) if shadow else None
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

    def _rows(self) -> list[torch.Tensor]:
        """Per bucket, the P ranks' buckets [P, n] (zeros: the padding, and slots no rank's backward reached)."""
        return [torch.zeros(self.world, b.numel, dtype=self.layout.groups[b.group][1]) for b in self.layout.buckets]

    def _lay_out(self, rows: list[torch.Tensor], rank: int) -> None:
        """This rank's gradients into row ``rank`` of each bucket, as the wrapper lays them out (reversed
        parameter order, zero padding)."""
        for b, bucket in zip(self.layout.buckets, rows, strict=True):
            mine = bucket[rank]
            for slot in b.slots:
                grad = self.params[slot.index].grad
                if grad is not None:
                    mine[slot.start : slot.start + slot.numel] = grad.reshape(-1)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold beyond the model, optimizer and scaler: the simulated ranks' reducer state
        (error-feedback residuals and stochastic-rounding streams), as ``{"feedback": [per bucket {"worker",
        "server"}], "generators": [per rank]}`` (each entry only when the reducer keeps it)."""
        model = self.reducer.model_state.state_dict() if hasattr(self.reducer, "model_state") else {}
        state: dict[str, Any] = {}
        tensors = model.get("tensors", {})
        if tensors:
            state["feedback"] = [tensors[k] for k in range(len(self.layout.buckets))]
        if model.get("generators") is not None:
            state["generators"] = model["generators"]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the configuration was checked against the checkpoint's already)."""
        p = self.cfg.parallel
        stochastic = p.rounding == "stochastic"
        streams = state.get("generators")
        if stochastic and (streams is None or len(streams) != self.world):
            raise ValueError("the checkpoint holds no stochastic-rounding streams for this simulated run")
        saved = state.get("feedback")
        if p.error_feedback and (saved is None or len(saved) != len(self.layout.buckets)):
            raise ValueError("the checkpoint holds no error-feedback residuals for this simulated run")
        if not (stochastic or p.error_feedback):
            return
        self.reducer.model_state.load_state_dict(
            {
                "world": self.world,
                "generators": list(streams) if stochastic else None,
                "tensors": dict(enumerate(saved)) if p.error_feedback else {},
            }
        )

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
        rows = self._rows()
        losses = torch.empty(self.world, 1, dtype=torch.float64)
        for rank in range(self.world):
            seed_step(self.parts, cfg, step, rank)
            losses[rank, 0] = self._local_gradient(self._microbatches(step, rank))
            self._lay_out(rows, rank)
        # Every rank holds the same bits after all_reduce: rank 0's row is the run's gradient.
        self._reduced = [self.reducer.model(r, average=True, key=k)[0] for k, r in enumerate(rows)]
        self.reduced = list(self._reduced) if self.shadow_reducer is not None else []
        if self.shadow_reducer is not None:
            self.shadow_reduced = [self.shadow_reducer.model(r, average=True, key=k)[0] for k, r in enumerate(rows)]
        del rows
        # The Updater recomputes rank 0's gradient (1/P of the work) and then takes the reduced one from
        # _publish: its unscale, overflow check, clipping and step are the real ranks' code.
        seed_step(self.parts, cfg, step, 0)
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
        return f"simulating {self.world} data-parallel ranks in this process, reduction model {self.reducer!r}"
