"""What a rank of ``mixprec train`` trains with, built from a TrainConfig: the model in its precision, the
data-parallel wrapper, the optimizer (with fp32 master weights for bf16/fp16), the loss scaler and the Updater.

docs/lab.md tables which precision each tensor has per ``model.precision``, on a CPU and on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.comm import Topology
from mixprec.emulate import RECIPES, Fingerprint, emulate_linear_layers
from mixprec.lab.band import perturb_weights
from mixprec.lab.config import LINEAR_MODES, TrainConfig
from mixprec.lab.data import dropout_seed, linear_rounding_seed
from mixprec.lab.model import GPT, GPTConfig, Linear
from mixprec.parallel import DistributedDataParallel
from mixprec.scaling import LossScaler, MasterWeightOptimizer, Updater

__all__ = [
    "DTYPES",
    "Parts",
    "autocast",
    "build_model",
    "build_parts",
    "gpt_config",
    "linear_generator",
    "reducer_options",
    "seed_step",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


@dataclass
class Parts:
    """What a rank trains with."""

    module: GPT  # the bare model (evaluation, checkpoints)
    model: torch.nn.Module  # what the Updater drives: the bare model, or the data-parallel wrapper around it
    optimizer: Any
    scaler: LossScaler
    updater: Updater
    wrapper: DistributedDataParallel | None
    linear_generator: torch.Generator | None = None  # the block-scaled linears' stream (see seed_step)


def gpt_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    """The model shape of ``cfg`` for a corpus of ``vocab_size`` characters (validated by GPTConfig)."""
    m = cfg.model
    return GPTConfig(
        vocab_size=vocab_size,
        block_size=m.block_size,
        n_layer=m.n_layer,
        n_head=m.n_head,
        n_embd=m.n_embd,
        dropout=m.dropout,
    )


def linear_generator(cfg: TrainConfig, device: torch.device) -> torch.Generator | None:
    """The generator of the block-scaled linears of a ``linear_mode`` recipe ('mxfp8', 'nvfp4'), on ``device``;
    None for the other modes (they draw nothing). :func:`seed_step` seeds it before each step."""
    return torch.Generator(device=device) if cfg.model.linear_mode in RECIPES else None


def seed_step(parts: Parts, cfg: TrainConfig, step: int, rank: int) -> None:
    """Seed rank ``rank``'s randomness of step ``step``: dropout (torch's global generator) and the block-scaled
    linears' stochastic rounding and Hadamard signs (``parts.linear_generator``). Both are functions of (seed,
    step, rank) alone, so a resumed run, and a simulated rank, draw what the uninterrupted real rank draws."""
    if cfg.model.dropout:
        torch.manual_seed(dropout_seed(cfg.training.seed, step, rank))
    if parts.linear_generator is not None:
        parts.linear_generator.manual_seed(linear_rounding_seed(cfg.training.seed, step, rank))


def build_model(
    cfg: TrainConfig, vocab_size: int, device: torch.device, *, generator: torch.Generator | None = None
) -> GPT:
    """The GPT of ``cfg``: initialised in fp32 on the CPU from ``seed`` (same weights on every device), then
    moved to ``device``, rounded to the precision's dtype, and given emulated linears when ``linear_mode`` asks
    (``generator``: a recipe's stream, see :func:`linear_generator`; None = torch's default generator)."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.training.seed)
    model = GPT(gpt_config(cfg, vocab_size))
    torch.random.set_rng_state(gen_state)
    model.to(device=device, dtype=DTYPES[cfg.model.precision])
    if cfg.training.perturb:
        perturb_weights(model, cfg.training.perturb)
    mode = cfg.model.linear_mode
    if mode != "off":
        # A mode that is no preset is a fingerprint file (ModelConfig checked it): the measured accelerator.
        matmul_model = mode if mode in LINEAR_MODES else Fingerprint.load(mode).model
        # The lab's Linear only casts dtypes. A recipe keeps layers that are not whole blocks (the LM head of a
        # vocabulary that is not) in the model's precision, with a warning.
        emulate_linear_layers(model, matmul_model, include=(Linear,), generator=generator)
    return model


def reducer_options(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    """``make_reducer(cfg.parallel.reduce, **options)``'s options for ``world_size`` ranks: the config's, and for
    a hierarchical reduction its topology (what a real run's wrapper and a simulated run's model both build)."""
    p = cfg.parallel
    options = p.reduce_options()
    if p.hierarchical:
        if not p.ranks_per_node:
            raise RuntimeError("ranks_per_node must be resolved before training (launch does it)")
        options["topology"] = Topology(nodes=world_size // p.ranks_per_node, ranks_per_node=p.ranks_per_node)
    return options


def _wrap_data_parallel(module: GPT, cfg: TrainConfig, world_size: int) -> DistributedDataParallel | None:
    """mixprec's DistributedDataParallel around ``module``, or None when there is nothing to reduce (one rank)."""
    if world_size == 1:
        return None
    p = cfg.parallel
    options = reducer_options(cfg, world_size)
    return DistributedDataParallel(
        module,
        reduce=p.reduce,
        reduce_options=options,
        sharded_optimizer=p.sharded_optimizer,
        audit_every=p.audit_every or None,
    )


def autocast(cfg: TrainConfig, device: torch.device) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """torch.autocast in the precision on a GPU; nothing on a CPU (it computes in fp32 and rounds the tensors
    under study instead, see docs/lab.md)."""
    if device.type == "cuda" and cfg.model.precision != "fp32":
        dtype = DTYPES[cfg.model.precision]
        return lambda: torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext


def build_parts(cfg: TrainConfig, vocab_size: int, device: torch.device, world_size: int) -> Parts:
    generator = linear_generator(cfg, device)
    module = build_model(cfg, vocab_size, device, generator=generator)
    wrapper = _wrap_data_parallel(module, cfg, world_size)
    opt_cls, opt_kwargs = _OPTIMIZERS[cfg.optimizer.name], cfg.optimizer.arguments()
    if wrapper is not None:
        # fp32 masters for bf16/fp16 parameters: MasterWeightOptimizer, or ShardedOptimizer's shard of them.
        optimizer: Any = wrapper.make_optimizer(opt_cls, **opt_kwargs)
    elif cfg.model.precision == "fp32":
        optimizer = opt_cls(module.parameters(), **opt_kwargs)
    else:
        optimizer = MasterWeightOptimizer(module.parameters(), opt_cls, **opt_kwargs)
    scaler = cfg.build_scaler()
    context = autocast(cfg, device)

    def loss_fn(m: torch.nn.Module, mb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = mb
        with context():
            _, loss = m(x, y)
        return loss

    model = wrapper if wrapper is not None else module
    updater = Updater(
        model,
        optimizer,
        loss_fn,
        scaler=scaler,
        num_microbatches=cfg.num_microbatches,
        clip_grad_norm=cfg.training.clip_grad_norm or None,
    )
    return Parts(module, model, optimizer, scaler, updater, wrapper, generator)
