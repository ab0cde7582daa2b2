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
import json
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mixprec.comm.live_audit import AuditResult, check_audit_every
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
        audit_every: None, or an int N >= 1: the live numerics audit (:mod:`mixprec.comm.live_audit`) on one
            reduce-scatter of every N-th backward pass.
        audit_log: with ``audit_every``, a file global rank 0 appends each audit's ``audit_*`` row to, one
            JSON object a line (torchtitan's own metrics logger is not reachable from ``parallelize_fn``);
            None = the rows are kept only in memory, on :func:`install`'s ``on_audit``.
    """

    reducer: str = "fp32_accumulate"
    rounding: str = "nearest"
    seed: int | None = None
    device: str = "cuda"
    hierarchical: bool = False
    inter_node_dtype: str | None = None
    audit_every: int | None = None
    audit_log: str | None = None

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
        check_audit_every(self.audit_every)
        if self.audit_log is not None:
            if not isinstance(self.audit_log, str) or not self.audit_log:
                raise TypeError(f"audit_log must be a file path (str) or None; got {self.audit_log!r}")
            if self.audit_every is None:
                raise ValueError("audit_log applies only with audit_every")

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


def install(
    model: torch.nn.Module, config: ReduceScatterConfig, *, on_audit: Callable[[AuditResult], None] | None = None
) -> int:
    """Install the reduce-scatter ``config`` describes on every ``fully_shard``-ed module of ``model``;
    returns how many. ValueError when ``model`` holds none (torchtitan applies FSDP only with
    ``data_parallel_shard_degree`` > 1, or context parallelism). ``on_audit``: called with each audit result
    (``config.audit_every``), after ``config.audit_log`` got its row."""
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
            audit_every=config.audit_every,
            on_audit=_audit_sink(config, on_audit),
        )
    except ValueError as exc:
        if "no fully_shard" not in str(exc):
            raise
        raise ValueError(
            "the parallelized model holds no fully_shard-ed module, so there is no reduce-scatter to replace: "
            "mixprec's reduce-scatter needs FSDP (torchtitan: parallelism.data_parallel_shard_degree > 1)"
        ) from None


def _audit_sink(
    config: ReduceScatterConfig, on_audit: Callable[[AuditResult], None] | None
) -> Callable[[AuditResult], None] | None:
    if on_audit is not None and not callable(on_audit):
        raise TypeError(f"on_audit must be callable or None; got {type(on_audit).__name__}")
    if config.audit_log is None or (dist.is_initialized() and dist.get_rank() != 0):
        return on_audit
    path = Path(config.audit_log)

    def sink(result: AuditResult) -> None:
        with path.open("a") as f:
            f.write(json.dumps(result.as_row()) + "\n")
        if on_audit is not None:
            on_audit(result)

    return sink


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
