"""Training throughput: ``mixprec train`` vs the same model in a plain torch DDP + torch.amp loop, same run.

Both sides train the lab's GPT (mixprec.lab.model) on the same batches with the same ranks (forked, gloo on CPU,
one thread each; one rank on a GPU, where NCCL cannot put two ranks on one device), AdamW, gradient clipping at
1.0 and microbatch accumulation. Throughput is tokens per second over the optimizer step (forward, backward,
reduction, unscale/clip, optimizer), median over the timed steps; making the batches and evaluation are outside
the timed region on both sides.

* baseline: ``torch.nn.parallel.DistributedDataParallel`` (``no_sync`` for all but the last microbatch), fp32
  parameters, ``torch.autocast`` in bf16/fp16 and ``torch.amp.GradScaler`` for fp16: what a user writes with
  torch alone.
* mixprec: ``mixprec.lab.launch.launch`` (the ``mixprec train`` command without argument parsing), with
  ``reduce`` native and fp32_accumulate. On a CPU its bf16/fp16 runs hold bf16/fp16 parameters and gradients but
  compute matmuls in fp32 (see docs/lab.md), while the baseline's autocast runs real bf16/fp16 CPU matmuls:
  the CPU ratio for bf16/fp16 compares two ways of studying low precision on a CPU, not equal arithmetic.

    python benchmarks/bench_train.py [--quick] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from _common import machine_header, markdown_table
from mixprec.lab.config import TrainConfig
from mixprec.lab.corpus import Corpus, load_corpus
from mixprec.lab.data import train_microbatches
from mixprec.lab.launch import launch
from mixprec.lab.metrics import METRICS_NAME, read_rows
from mixprec.lab.model import GPT, GPTConfig
from mixprec.testing import run_distributed

_AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class _TorchLoop:
    """The torch-only training step: torch DDP (no_sync for all but the last microbatch), fp32 parameters,
    torch.autocast in bf16/fp16, torch.amp.GradScaler for fp16, clip_grad_norm_, AdamW."""

    def __init__(self, cfg: TrainConfig, vocab_size: int, device: torch.device, world_size: int) -> None:
        torch.manual_seed(cfg.training.seed)
        self.model = GPT(
            GPTConfig(
                vocab_size=vocab_size,
                block_size=cfg.model.block_size,
                n_layer=cfg.model.n_layer,
                n_head=cfg.model.n_head,
                n_embd=cfg.model.n_embd,
            )
        ).to(device)
        distributed = dist.is_initialized() and world_size > 1
        self.ddp = torch.nn.parallel.DistributedDataParallel(self.model) if distributed else self.model
        # Same hyperparameters as mixprec's optimizer (torch's AdamW defaults to weight_decay=0.01, the lab to 0).
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.optimizer.lr,
            betas=cfg.optimizer.betas,
            weight_decay=cfg.optimizer.weight_decay,
        )
        self.amp_dtype = _AMP[cfg.model.precision]
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.model.precision == "fp16")
        self.device = device
        self.cfg = cfg

    def step(self, mbs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        nmb = len(mbs)
        self.opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(mbs):
            sync = i == nmb - 1 or not hasattr(self.ddp, "no_sync")
            with contextlib.nullcontext() if sync else self.ddp.no_sync():
                with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
                    _, loss = self.ddp(x, y)
                self.scaler.scale(loss / nmb).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.training.clip_grad_norm)
        self.scaler.step(self.opt)
        self.scaler.update()
        float(loss.detach())  # the host sync mixprec's loop does to log the loss


def _batches(corpus: Corpus, cfg: TrainConfig, step: int, rank: int, world_size: int, device: torch.device) -> list:
    mbs = train_microbatches(
        corpus.train,
        seed=cfg.training.seed,
        step=step,
        global_batch_size=cfg.data.global_batch_size,
        micro_batch_size=cfg.data.micro_batch_size,
        block_size=cfg.model.block_size,
        rank=rank,
        world_size=world_size,
    )
    return [(x.to(device), y.to(device)) for x, y in mbs]


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _baseline_rank(rank: int, world_size: int, cfg: TrainConfig, warmup: int, device: str) -> list[float]:
    """Seconds per optimizer step of the torch-only loop on this rank (timed steps only)."""
    corpus = load_corpus(cfg.data.corpus)
    dev = torch.device(device)
    loop = _TorchLoop(cfg, corpus.vocab_size, dev, world_size)
    times = []
    for step in range(cfg.training.steps):
        mbs = _batches(corpus, cfg, step, rank, world_size, dev)
        t = _timed(lambda mbs=mbs: loop.step(mbs), dev)
        if step >= warmup:
            times.append(t)
    return times


def _interleaved_rank(
    rank: int, world_size: int, cfgs: list[TrainConfig], warmup: int, device: str
) -> list[list[float]]:
    """Seconds per step of the torch loop and of mixprec's step for each of ``cfgs``, alternating step by step in
    the same processes, so that a load change on a shared machine hits every side alike. The mixprec step is
    what ``mixprec train`` times: ``Updater.step`` over the parts ``build_parts`` makes (model in the precision's
    dtype, DistributedDataParallel, master-weight optimizer, loss scaler) plus the loss all-reduce."""
    from mixprec.comm.objects import all_reduce_sum_fp64
    from mixprec.lab.build import build_parts

    corpus = load_corpus(cfgs[0].corpus)
    dev = torch.device(device)
    loop = _TorchLoop(cfgs[0], corpus.vocab_size, dev, world_size)
    parts = [build_parts(cfg, corpus.vocab_size, dev, world_size) for cfg in cfgs]
    times: list[list[float]] = [[] for _ in range(1 + len(cfgs))]

    def mixprec_step(p: Any, mbs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        result = p.updater.step(mbs)
        all_reduce_sum_fp64([result.loss])

    for step in range(cfgs[0].steps):
        mbs = _batches(corpus, cfgs[0], step, rank, world_size, dev)
        samples = [_timed(lambda mbs=mbs: loop.step(mbs), dev)]
        samples += [_timed(lambda p=p, mbs=mbs: mixprec_step(p, mbs), dev) for p in parts]
        if step >= warmup:
            for k, t in enumerate(samples):
                times[k].append(t)
    return times


def baseline_tokens_per_s(cfg: TrainConfig, warmup: int, device: str) -> float:
    if cfg.parallel.nproc == 1:
        times = _baseline_rank(0, 1, cfg, warmup, device)
    else:
        times = run_distributed(_baseline_rank, cfg.parallel.nproc, cfg, warmup, device, timeout=3600)[0]
    return cfg.data.global_batch_size * cfg.model.block_size / statistics.median(times)


def interleaved_tokens_per_s(cfgs: list[TrainConfig], warmup: int, device: str) -> list[float]:
    """tokens/s of [torch loop, mixprec step for each cfg], measured alternating in the same ranks."""
    if cfgs[0].parallel.nproc == 1:
        times = _interleaved_rank(0, 1, cfgs, warmup, device)
    else:
        times = run_distributed(_interleaved_rank, cfgs[0].parallel.nproc, cfgs, warmup, device, timeout=3600)[0]
    tokens = cfgs[0].data.global_batch_size * cfgs[0].model.block_size
    return [tokens / statistics.median(t) for t in times]


def mixprec_tokens_per_s(cfg: TrainConfig, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = cfg.replace(training={"out_dir": os.path.join(tmp, "run")})
        with contextlib.redirect_stdout(io.StringIO()):  # the run's own log lines (forked ranks inherit it)
            launch(cfg, overwrite=True, progress=False)
        rows = list(read_rows(os.path.join(cfg.training.out_dir, METRICS_NAME)))[warmup:]
    return statistics.median(r["tokens_per_s"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few steps (seconds)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="steps per run, the first 3 untimed")
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of each side, alternating; the best is kept (default 3, quick 1)",
    )
    args = parser.parse_args()
    if args.device == "cpu":
        shape = dict(n_layer=2, n_head=4, n_embd=128, block_size=64, global_batch_size=32, micro_batch_size=8)
        nproc, steps = 2, 23
        if args.quick:
            shape = dict(n_layer=1, n_head=2, n_embd=32, block_size=16, global_batch_size=8, micro_batch_size=2)
            steps = 8
    else:
        shape = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, global_batch_size=64, micro_batch_size=32)
        nproc, steps = 1, 53
        if args.quick:
            steps = 13
    steps = args.steps or steps
    warmup = 3
    repeats = args.repeats or (1 if args.quick else 3)
    base = dict(**shape, nproc=nproc, steps=steps, eval_interval=0, checkpoint_interval=0, device=args.device)

    print(machine_header(f"mixprec train vs torch DDP + torch.amp: tokens/s ({args.device})"))
    print(
        f"Model {shape['n_layer']} layers x {shape['n_embd']} channels, context {shape['block_size']}, "
        f"GBS {shape['global_batch_size']}, MBS {shape['micro_batch_size']}, {nproc} rank(s), "
        f"{steps} steps of which {warmup} untimed; tokens/s = median over the timed steps; best of {repeats} "
        "alternating run(s) per side.\n"
    )
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        # Alternate the sides and keep each one's best run: on a shared machine the load changes between runs,
        # and the best run is the one least disturbed by it.
        ref = native = acc = 0.0
        for _ in range(repeats):
            ref = max(
                ref, baseline_tokens_per_s(TrainConfig.from_dict({**base, "precision": precision}), warmup, args.device)
            )
            native = max(native, mixprec_tokens_per_s(TrainConfig.from_dict({**base, "precision": precision}), warmup))
            if nproc > 1:
                cfg = TrainConfig.from_dict({**base, "precision": precision, "reduce": "fp32_accumulate"})
                acc = max(acc, mixprec_tokens_per_s(cfg, warmup))
        row: list[object] = [precision, round(ref), round(native), native / ref]
        row += [round(acc), acc / ref] if nproc > 1 else ["- (1 rank)", "-"]
        rows.append(row)
        print(f"  {precision} done", file=sys.stderr, flush=True)
    header = [
        "precision",
        "torch DDP + torch.amp tok/s",
        "mixprec reduce=native tok/s",
        "ratio (mixprec / torch)",
        "mixprec reduce=fp32_accumulate tok/s",
        "ratio (mixprec / torch)",
    ]
    print(markdown_table(header, rows))

    print(
        "\nSame ranks, steps alternating (torch loop, then mixprec's step per reduction, on the same batch): "
        "a load change hits every side alike, so these ratios are the robust ones on a shared machine.\n"
    )
    reductions = ["native", "fp32_accumulate"] if nproc > 1 else ["native"]
    rows = []
    for precision in ("fp32", "bf16", "fp16"):
        cfgs = [TrainConfig.from_dict({**base, "precision": precision, "reduce": r}) for r in reductions]
        tps = interleaved_tokens_per_s(cfgs, warmup, args.device)
        row = [precision, round(tps[0])]
        for value in tps[1:]:
            row += [round(value), value / tps[0]]
        rows.append(row)
        print(f"  {precision} done (interleaved)", file=sys.stderr, flush=True)
    header = ["precision", "torch DDP + torch.amp tok/s"]
    for r in reductions:
        header += [f"mixprec step reduce={r} tok/s", "ratio (mixprec / torch)"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
