"""mixprec inside torchtitan: FSDP2's reduce-scatter with fp32 accumulation, chosen from the job's config.

torchtitan's ``training.mixed_precision_reduce`` picks only FSDP's reduce dtype; the reduction itself is
the backend's. A model's ``ModelSpec.parallelize_fn`` applies ``fully_shard``; wrapping it installs
:class:`mixprec.fsdp.FP32AccumulateReduceScatter` on every FSDP module it made
(``FSDPModule.set_custom_reduce_scatter``, torch >= 2.13). In a torchtitan 0.3 config function::

    config = llama3_debugmodel()
    config.model_spec = with_mixprec_reduce(config.model_spec, ReduceScatterConfig(rounding="stochastic", seed=0))

or from a ``[mixprec]`` table of a TOML file: ``ReduceScatterConfig.from_toml("job.toml")``. The pipeline
schedule calls the same ``parallelize_fn`` per stage, so every stage gets it. Only ``"fp32_accumulate"`` runs
as FSDP2's reduce-scatter (compressed reducers need DDP's buckets): others are refused when the config is built.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mixprec.core.random import rank_stream
from mixprec.core.validate import check_choice

__all__ = ["ReduceScatterConfig", "install", "with_mixprec_reduce", "wrap_parallelize"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class ReduceScatterConfig:
    """What the wrapped ``parallelize_fn`` installs; every field is a plain value a TOML table can hold.

    Attributes:
        reducer: ``"fp32_accumulate"`` (the only reducer FSDP2's reduce-scatter can run).
        rounding: ``"nearest"`` or ``"stochastic"`` (the single rounding to the reduce dtype).
        seed: with stochastic rounding, the stream is ``torch.Generator().manual_seed(seed + global rank)``
            on the gradients' device type of ``device``; None = mixprec's seeded per-process default.
        device: ``"cpu"`` or ``"cuda"``: where that generator lives.
        inter_node_dtype: None or ``"float32"``: with ``LOCAL_WORLD_SIZE`` < world, node partials sent in fp32
            (the two-stage scheme of ``mixprec.comm.hierarchical_fp32``).
        hierarchical: use the two-stage multi-node scheme (topology from torchrun's ``LOCAL_WORLD_SIZE``).
    """

    reducer: str = "fp32_accumulate"
    rounding: str = "nearest"
    seed: int | None = None
    device: str = "cuda"
    hierarchical: bool = False
    inter_node_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.reducer != "fp32_accumulate":
            raise ValueError(
                f"reducer={self.reducer!r} cannot run as FSDP2's reduce-scatter; only 'fp32_accumulate' can "
                "(compressed reducers need DDP buckets: mixprec.DistributedDataParallel or mixprec.hooks)"
            )
        check_choice("rounding", self.rounding, ("nearest", "stochastic"))
        check_choice("device", self.device, ("cpu", "cuda"))
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None; got {type(self.seed).__name__}")
        if not isinstance(self.hierarchical, bool):
            raise TypeError(f"hierarchical must be a bool; got {type(self.hierarchical).__name__}")
        if self.inter_node_dtype is not None:
            check_choice("inter_node_dtype", self.inter_node_dtype, ("float32",))
            if not self.hierarchical:
                raise ValueError("inter_node_dtype applies only with hierarchical=true")

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> ReduceScatterConfig:
        """From a mapping of the field names (TypeError naming an unknown key)."""
        if not isinstance(table, Mapping):
            raise TypeError(f"table must be a mapping; got {type(table).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise TypeError(f"unknown mixprec setting(s) {unknown}; accepted: {sorted(known)}")
        return cls(**table)

    @classmethod
    def from_toml(cls, path: str | Path, section: str = "mixprec") -> ReduceScatterConfig:
        """From the ``[section]`` table of a TOML file (ValueError when the file has no such table)."""
        with open(path, "rb") as f:
            data = tomllib.load(f)
        if section not in data:
            raise ValueError(f"{path} has no [{section}] table")
        return cls.from_dict(data[section])


def install(model: torch.nn.Module, config: ReduceScatterConfig) -> int:
    """Install the reduce-scatter ``config`` describes on every ``fully_shard``-ed module of ``model``;
    returns how many. ValueError when ``model`` holds none (torchtitan applies FSDP only with
    ``data_parallel_shard_degree`` > 1, or context parallelism)."""
    from mixprec.integrations.fsdp2 import use_fp32_accumulation

    if not isinstance(config, ReduceScatterConfig):
        raise TypeError(f"config must be a ReduceScatterConfig; got {type(config).__name__}")
    generator = None
    if config.rounding == "stochastic" and config.seed is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        generator = rank_stream(config.seed, config.device, rank)  # its own object, not the cached one
    topology = None
    if config.hierarchical:
        from mixprec.comm.topology import Topology

        topology = Topology.from_env()
    try:
        return use_fp32_accumulation(
            model,
            rounding=config.rounding,  # type: ignore[arg-type]
            generator=generator,
            topology=topology,
            inter_node_dtype=None if config.inter_node_dtype is None else _DTYPES[config.inter_node_dtype],
        )
    except ValueError as exc:
        if "no fully_shard" not in str(exc):
            raise
        raise ValueError(
            "the parallelized model holds no fully_shard-ed module, so there is no reduce-scatter to replace: "
            "mixprec's reduce-scatter needs FSDP (torchtitan: parallelism.data_parallel_shard_degree > 1)"
        ) from None


def wrap_parallelize(parallelize_fn: Callable[..., Any], config: ReduceScatterConfig) -> Callable[..., Any]:
    """``parallelize_fn`` followed by :func:`install` on the module it returns (any signature: the
    arguments pass through unchanged)."""
    if not callable(parallelize_fn):
        raise TypeError(f"parallelize_fn must be callable; got {type(parallelize_fn).__name__}")
    if not isinstance(config, ReduceScatterConfig):
        raise TypeError(f"config must be a ReduceScatterConfig; got {type(config).__name__}")

    @functools.wraps(parallelize_fn)
    def parallelize(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = parallelize_fn(model, *args, **kwargs)
        install(out if isinstance(out, torch.nn.Module) else model, config)
        return out

    parallelize.mixprec_config = config  # type: ignore[attr-defined]
    return parallelize


def with_mixprec_reduce(model_spec: Any, config: ReduceScatterConfig) -> Any:
    """A copy of torchtitan's ``ModelSpec`` (a dataclass with ``parallelize_fn``) whose ``parallelize_fn``
    installs mixprec's reduce-scatter; wrapping twice is refused (ValueError)."""
    if not dataclasses.is_dataclass(model_spec) or not hasattr(model_spec, "parallelize_fn"):
        raise TypeError(f"model_spec must be torchtitan's ModelSpec; got {type(model_spec).__name__}")
    if hasattr(model_spec.parallelize_fn, "mixprec_config"):
        raise ValueError("model_spec's parallelize_fn already installs mixprec's reduce-scatter")
    return dataclasses.replace(model_spec, parallelize_fn=wrap_parallelize(model_spec.parallelize_fn, config))
