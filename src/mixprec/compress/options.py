"""What :class:`~mixprec.compress.CompressedReducer` (mixprec's DDP) and :class:`~mixprec.hooks.CompressedHookState`
(torch DDP) share: their validated options, the per-device compressors with their rank-seeded streams, and
the checks of the state they save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.comm.topology import Topology, check_topology
from mixprec.compress.blockscaled import BLOCK_WIRES, BlockScaledWire, check_block_wire
from mixprec.compress.fp8 import FP8_FORMATS, Compressor, ScaledFP8
from mixprec.compress.quantize import CHECK_FINITE, MinMaxUInt8
from mixprec.compress.state import ErrorFeedback
from mixprec.core.dtypes import ROUNDINGS
from mixprec.core.random import DEFAULT_STOCHASTIC_SEED, rounding_generator
from mixprec.core.validate import check_bool, check_choice, check_positive_int

__all__ = ["DEFAULT_CHUNK_SIZE", "WIRES", "CompressionOptions", "build_compressor"]

# Elements per chunk (one header entry) of the data-parallel compressors: ByteGrad's block, 0.4% of header bytes.
DEFAULT_CHUNK_SIZE = 2048

# What goes on the wire: min-max uint8, fp8 with per-chunk scales, block-scaled MX / NVFP4 (compress/blockscaled.py),
# or a choice per bucket among the first three (compress/auto.py). "auto" stays last.
WIRES: tuple[str, ...] = ("uint8", *FP8_FORMATS, *BLOCK_WIRES, "auto")


@dataclass(frozen=True)
class CompressionOptions:
    """Options of compressed gradient reduction in data parallelism (every wire), validated at construction.

    Formerly ``Uint8Options`` (still importable from :mod:`mixprec.compress` with a DeprecationWarning).

    Attributes:
        chunk_size: elements per chunk (one header entry), int >= 1.
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; the generator is
            ``mixprec.comm.rank_generator(seed, device)``: seeded with ``seed + global rank``, on the
            gradients' device, created at the first reduction; one 64-bit Philox key drawn per reduction).
        error_feedback: keep per-bucket residuals (worker and server side) and add them back next step.
        check_finite: ``"flag"`` (non-finite chunks reduce to NaN on every rank, for the loss scaler's agreed
            overflow check) or ``"raise"`` (every rank raises :class:`mixprec.compress.NonFiniteError`).
        topology: None (flat) or a :class:`Topology` / 2-D DeviceMesh ("node", "local") (hierarchical; the
            group must be the default group). Checked against the group size once torch.distributed is
            initialised.
        seed: base seed of the stochastic-rounding stream, an int.
        wire: ``"uint8"`` (:class:`~mixprec.compress.MinMaxUInt8`), ``"e4m3"`` / ``"e5m2"``
            (:class:`~mixprec.compress.ScaledFP8`), ``"mxfp8_e4m3"`` / ``"mxfp8_e5m2"`` / ``"mxfp4_e2m1"`` /
            ``"nvfp4"`` (:class:`~mixprec.compress.BlockScaledWire`, chunk_size a multiple of the block size)
            or ``"auto"``: per bucket, full precision (fp32 sums), uint8
            or fp8, from a cost model of the link rate and this machine's quantizing cost (``docs/compress.md``).
        link_gbps: ``"auto"`` only: the link rate in Gbit/s, a float > 0; None = probe it at the first
            reduction (rank 0's measurement, broadcast).
    """

    chunk_size: int = DEFAULT_CHUNK_SIZE
    rounding: str = "nearest"
    error_feedback: bool = False
    check_finite: str = "flag"
    topology: Any = None
    seed: int = DEFAULT_STOCHASTIC_SEED
    wire: str = "uint8"
    link_gbps: float | None = None

    def __post_init__(self) -> None:
        check_choice("wire", self.wire, WIRES)
        if self.link_gbps is not None:
            if isinstance(self.link_gbps, bool) or not isinstance(self.link_gbps, (int, float)):
                raise TypeError(f"link_gbps must be a float or None; got {type(self.link_gbps).__name__}")
            if not (math.isfinite(self.link_gbps) and self.link_gbps > 0):
                raise ValueError(f"link_gbps must be a finite number > 0; got {self.link_gbps}")
        check_positive_int("chunk_size", self.chunk_size)
        if self.wire in BLOCK_WIRES:
            check_block_wire(self.wire, self.chunk_size)
        check_choice("rounding", self.rounding, ROUNDINGS)
        check_bool("error_feedback", self.error_feedback)
        check_choice("check_finite", self.check_finite, CHECK_FINITE)
        if self.topology is not None:
            check_topology(self.topology)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int; got {type(self.seed).__name__}")
        if not -(2**63) <= self.seed < 2**64:  # refused here, not first inside a backward hook
            raise ValueError(f"seed must lie in torch's seed range [-2**63, 2**64); got {self.seed}")

    def saved(self) -> dict[str, Any]:
        """The options that change results and residual sizes, as saved in a state dict."""
        return {
            "rounding": self.rounding,
            "chunk_size": self.chunk_size,
            "check_finite": self.check_finite,
            "topology": topology_key(self.topology),
            "wire": self.wire,
        }

    def check_saved(self, state: dict[str, Any], owner: str) -> None:
        """ValueError when ``state`` was saved with other options than these (keys it lacks are not checked)."""
        for name, value in self.saved().items():
            if name in state and state[name] != value:
                raise ValueError(f"state was saved with {name}={state[name]!r}; this {owner} uses {value!r}")


def topology_key(topology: Any) -> list[int] | None:
    """What of a topology changes results and residual sizes: None (flat) or [nodes, ranks_per_node]."""
    if topology is None:
        return None
    if isinstance(topology, Topology):
        return [topology.nodes, topology.ranks_per_node]
    return [int(n) for n in topology.mesh.shape]  # a DeviceMesh, validated by check_topology


def check_generator_state(state: Any) -> torch.Tensor:
    """A saved ``torch.Generator.get_state()``: a 1-D uint8 tensor (TypeError otherwise)."""
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        got = (
            f"{state.dtype} tensor of shape {tuple(state.shape)}"
            if isinstance(state, torch.Tensor)
            else type(state).__name__
        )
        raise TypeError(f"generator_state must be a 1-D uint8 tensor (torch.Generator.get_state()); got {got}")
    return state


def check_feedback_entry(where: str, key: Any, entry: Any) -> dict[str, Any]:
    """A bucket key (int >= 0) and its saved residuals (a dict) from a state dict's ``error_feedback``."""
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise TypeError(f"{where} keys must be bucket keys, ints >= 0; got {key!r}")
    if not isinstance(entry, dict):
        raise TypeError(f"{where}[{key}] must be a dict; got {type(entry).__name__}")
    return entry


def load_feedback(entry: dict[str, Any]) -> ErrorFeedback:
    """A validated :class:`ErrorFeedback` from its saved residuals."""
    feedback = ErrorFeedback()
    feedback.load_state_dict(entry)
    return feedback


def build_compressor(options: CompressionOptions, wire: str, generator: torch.Generator | None) -> Compressor:
    """The compressor of ``wire`` (``"uint8"``, ``"e4m3"``, ``"e5m2"``) with ``options``' chunk size, rounding
    and check_finite, drawing stochastic keys from ``generator``."""
    kwargs: dict[str, Any] = {
        "chunk_size": options.chunk_size,
        "rounding": options.rounding,
        "generator": generator,
        "check_finite": options.check_finite,
    }
    if wire == "uint8":
        return MinMaxUInt8(**kwargs)
    if wire in FP8_FORMATS:
        return ScaledFP8(wire, **kwargs)
    if wire in BLOCK_WIRES:
        return BlockScaledWire(wire, **kwargs)
    raise ValueError(f"wire must be one of {', '.join(map(repr, WIRES[:-1]))} here; got {wire!r}")


class RankCompressors:
    """One compressor per (device, wire) with ``options``; stochastic rounding draws from
    ``rank_generator(options.seed, device)``, created at first use (when the process group is up). A
    generator state loaded before that is applied then."""

    def __init__(self, options: CompressionOptions) -> None:
        self.options = options
        self._by_device: dict[tuple[torch.device, str], Compressor] = {}
        self._generator: torch.Generator | None = None  # the stream last drawn from
        self._pending: tuple[torch.Tensor, str | None] | None = None  # (state, saved device) before first use

    def for_device(self, device: torch.device, wire: str | None = None) -> Compressor:
        """The compressor of ``wire`` (default: the options' wire; ``"auto"`` must name one) on ``device``.
        All wires of a device share one stochastic stream."""
        wire = self.options.wire if wire is None else wire
        comp = self._by_device.get((device, wire))
        if comp is None:
            opts = self.options
            shared = next((c.generator for (d, _), c in self._by_device.items() if d == device), None)
            generator = rounding_generator(opts.rounding, shared, device, opts.seed)
            # The device's first stochastic compressor: a generator state loaded before now applies to its stream.
            if generator is not shared and self._pending is not None:
                _apply(generator, *self._pending)
                self._pending = None
            comp = self._by_device[device, wire] = build_compressor(opts, wire, generator)
        self._generator = comp.generator
        return comp

    def saved(self) -> dict[str, Any]:
        """``generator_state`` and ``generator_device`` of the stream (nothing before it exists)."""
        if self._generator is not None:
            return {"generator_state": self._generator.get_state(), "generator_device": str(self._generator.device)}
        if self._pending is not None:
            state, device = self._pending
            return {"generator_state": state.clone(), **({} if device is None else {"generator_device": device})}
        return {}

    def check_saved(self, state: dict[str, Any], owner: str) -> tuple[torch.Tensor, str | None] | None:
        """Validate ``state``'s generator entries without applying them (TypeError/ValueError)."""
        gen_state = state.get("generator_state")
        if gen_state is None:
            return None
        check_generator_state(gen_state)
        device = state.get("generator_device")
        if device is not None:
            if not isinstance(device, str):
                raise TypeError(f"state['generator_device'] must be a str; got {type(device).__name__}")
            torch.device(device)  # a malformed device string fails here, not at the first reduction
            if self._generator is not None:
                _check_device(self._generator, device)
        if self.options.rounding != "stochastic":
            raise ValueError(f"state holds a generator state but this {owner} rounds to nearest")
        return gen_state, device

    def load(self, checked: tuple[torch.Tensor, str | None] | None) -> None:
        """Apply what :meth:`check_saved` returned (now, or at the first reduction)."""
        if checked is None:
            return
        if self._generator is not None:
            _apply(self._generator, *checked)
        else:
            self._pending = (checked[0].clone(), checked[1])


def _check_device(generator: torch.Generator, saved_device: str | None) -> None:
    # CPU and CUDA generator states have different formats: never load one into the other.
    if saved_device is not None and torch.device(saved_device).type != generator.device.type:
        raise ValueError(
            f"generator_state was saved from a generator on {saved_device}; this run draws on {generator.device}"
        )


def _apply(generator: torch.Generator, state: torch.Tensor, saved_device: str | None) -> None:
    _check_device(generator, saved_device)
    generator.set_state(state)
