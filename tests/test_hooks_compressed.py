"""``mixprec.hooks.compressed_hook`` / ``CompressedHookState``: the names, the block-scaled wires and the audit.

The old names (``uint8_compress_hook``, ``Uint8HookState``) are deprecated aliases that warn and are the same
objects; nothing in the repository but this file uses them. On 2 gloo ranks, torch DDP with the hook gives the
bits of mixprec's wrapper with the same reducer on uint8 and NVFP4, audited or not; the uint8 result is also
the independent numpy reference's (tests/compress_reference.py: ByteGrad's scheme). The audit rows are checked
against a float64 recomputation from every rank's local gradient, and the uint8 error against the quantizer's
per-element bound (docs/compress.md, "Error of a compressed collective"). The wrapper's ``audit_sample``
reaches the live audit's sample.
"""

from __future__ import annotations

import ast
import copy
import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import mixprec.hooks
from compress_reference import U32, ref_flat_all_reduce, ref_flat_reduce, roundtrip_bound
from mixprec.integrations.ddp_uint8 import CompressedHookState, compressed_hook
from mixprec.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
OLD = {"Uint8HookState": CompressedHookState, "uint8_compress_hook": compressed_hook}
CHUNK = 64  # divides each rank's part (384) of the 768-element bucket, and NVFP4's block of 16
STEPS = 3


# ---------------------------------------------------------------------------- names
@pytest.mark.parametrize("old", sorted(OLD))
def test_old_name_warns_and_is_the_same_object(old: str) -> None:
    new = OLD[old]
    with pytest.warns(
        DeprecationWarning, match=rf"mixprec\.hooks\.{old} is deprecated.*use mixprec\.hooks\.{new.__name__}"
    ):
        alias = getattr(mixprec.hooks, old)
    assert alias is new
    with pytest.warns(DeprecationWarning) as record:
        exec(f"from mixprec.hooks import {old} as imported", namespace := {})
    assert namespace["imported"] is new
    assert record[0].filename == "<string>"  # the warning points at the importing line, not at mixprec
    assert old not in mixprec.hooks.__all__ and old in dir(mixprec.hooks)


def test_new_names_are_public_and_unknown_names_still_fail() -> None:
    assert {"CompressedHookState", "compressed_hook"} <= set(mixprec.hooks.__all__)
    assert mixprec.hooks.CompressedHookState is CompressedHookState and mixprec.hooks.compressed_hook is compressed_hook
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from mixprec.hooks import *", {})  # names no deprecated alias
    with pytest.raises(AttributeError, match="no attribute 'uint16_compress_hook'"):
        mixprec.hooks.uint16_compress_hook  # noqa: B018


def test_no_code_or_page_names_an_old_hook_name() -> None:
    """Code: no identifier, attribute or import of an old name outside the alias table and this file; pages:
    none outside the changelog (which records the rename)."""
    hits = []
    for folder in ("src", "tests", "examples", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path in (ROOT / "src" / "mixprec" / "hooks.py", Path(__file__).resolve()):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [node.id]
                    if isinstance(node, ast.Name)
                    else [node.attr]
                    if isinstance(node, ast.Attribute)
                    else [a.name for a in node.names]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if set(OLD) & set(names):
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    pattern = re.compile("|".join(OLD))
    for path in [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md")]:
        if path.name != "CHANGELOG.md" and pattern.search(path.read_text()):
            hits.append(str(path.relative_to(ROOT)))
    assert not hits, hits


# ---------------------------------------------------------------------------- torch DDP on 2 gloo ranks
def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    # one parameter of 768 elements, a multiple of lcm(P, 128): one bucket, the same layout in the wrapper
    return torch.nn.Sequential(torch.nn.Linear(6, 128, bias=False), torch.nn.Tanh())


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 128, generator=g)


def _train(wrapped: torch.nn.Module, net: torch.nn.Module, rank: int, local: list | None = None) -> list:
    """Three SGD steps; every step's reduced gradient (and, into ``local``, this rank's own gradient)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    grads = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        if local is not None:
            alone = copy.deepcopy(net)
            torch.nn.functional.mse_loss(alone(x), y).backward()
            local.append(alone[0].weight.grad.reshape(-1).clone())
        opt.zero_grad()
        torch.nn.functional.mse_loss(wrapped(x), y).backward()
        grads.append(net[0].weight.grad.reshape(-1).clone())
        opt.step()
    return grads


def _hook_case(rank: int, world_size: int) -> dict:
    from mixprec.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    out: dict = {}
    for name, wire in (("uint8", "uint8"), ("nvfp4", "nvfp4")):
        runs: dict = {}
        for consumer in ("audited", "hook", "wrapper"):
            net = _net()
            if consumer == "wrapper":
                wrapped = DistributedDataParallel(net, reduce=name, reduce_options={"chunk_size": CHUNK})
            else:
                wrapped = torch.nn.parallel.DistributedDataParallel(net)
                heard: list = []
                audit = {"audit_every": 1, "on_audit": heard.append} if consumer == "audited" else {}
                state = CompressedHookState(chunk_size=CHUNK, wire=wire, **audit)
                wrapped.register_comm_hook(state, compressed_hook)
            local: list = []
            runs[consumer] = _train(wrapped, net, rank, local if consumer == "audited" else None)
            if consumer == "audited":
                runs["local"] = local
                runs["rows"] = state.audit_rows
                runs["heard"] = [r.as_row() for r in heard]
            del wrapped
        out[name] = runs
    # the wrapper's audit_sample: 256 elements of the 768 (128 from each rank's shard), then the whole bucket
    for sample in (256, None):
        net = _net()
        wrapped = DistributedDataParallel(
            net, reduce="uint8", reduce_options={"chunk_size": CHUNK}, audit_every=1, audit_sample=sample
        )
        local = []
        out[f"sample {sample}"] = {"grads": _train(wrapped, net, rank, local), "local": local}
        out[f"sample {sample}"]["rows"] = [r.as_row() for r in wrapped.audit_results]
        del wrapped
    errors = []
    for bad in (0, 2.5, True):
        try:
            DistributedDataParallel(_net(), audit_every=1, audit_sample=bad)
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    torch.distributed.barrier()  # nothing was left half-issued: the group still works
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def hooked() -> list[dict]:
    return run_distributed(_hook_case, 2, timeout=300)


def _exact(local: list[list[torch.Tensor]], step: int) -> np.ndarray:
    """The audit's exact reduction: the fp64 sum of the ranks' fp32 gradients, divided by P."""
    return (local[0][step].double().numpy() + local[1][step].double().numpy()) / 2


def _rel_l2(result: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(result - exact) / np.linalg.norm(exact))


@pytest.mark.parametrize("name", ["uint8", "nvfp4"])
def test_hook_gives_the_wrappers_bits_audited_or_not(hooked: list[dict], name: str) -> None:
    for rank in hooked:
        runs = rank[name]
        for step in range(STEPS):
            assert torch.equal(runs["audited"][step], runs["hook"][step]), (name, step)  # the audit reads only
            assert torch.equal(runs["hook"][step], runs["wrapper"][step]), (name, step)
    assert torch.equal(hooked[0][name]["hook"][STEPS - 1], hooked[1][name]["hook"][STEPS - 1])


@pytest.mark.parametrize("name", ["uint8", "nvfp4"])
def test_audit_rows_measure_the_hooks_error(hooked: list[dict], name: str) -> None:
    local = [hooked[0][name]["local"], hooked[1][name]["local"]]
    for rank in hooked:
        runs = rank[name]
        assert runs["heard"] == runs["rows"]  # on_audit got each row as it was recorded
        assert [r["audit_step"] for r in runs["rows"]] == [1, 2, 3]
        for step, row in enumerate(runs["rows"]):
            assert (row["audit_bucket"], row["audit_numel"], row["audit_wire_dtype"]) == (0, 768, "float32")
            exact = _exact(local, step)
            result = runs["audited"][step].double().numpy()
            assert row["audit_rel_l2"] == pytest.approx(_rel_l2(result, exact), rel=1e-12)
            assert row["audit_max_abs"] == float(np.abs(result - exact).max())
            assert row["audit_rel_l2"] > 0 and row["audit_nonfinite_inputs"] == row["audit_nonfinite_results"] == 0
            # the backend's own: pre-divide by 2 (exact), one fp32 sum: one rounding, u = 2^-24
            assert row["audit_native_rel_l2"] <= U32


def test_uint8_rows_within_the_reducers_bound(hooked: list[dict]) -> None:
    local = [hooked[0]["uint8"]["local"], hooked[1]["uint8"]["local"]]
    for step in range(STEPS):
        rows = [local[r][step].numpy() for r in range(2)]
        result = hooked[0]["uint8"]["audited"][step].numpy()
        assert np.array_equal(result, ref_flat_all_reduce(rows, CHUNK)[0][0])  # ByteGrad's scheme, independently
        # Each rank's quantization (halved by the average), the fp32 sum's rounding at the owner, and the owner's
        # quantization of what it reduced: the per-element bound of docs/compress.md.
        server = np.concatenate(ref_flat_reduce(rows, CHUNK, divisor=2))
        bound = (
            (roundtrip_bound(rows[0], CHUNK, "nearest") + roundtrip_bound(rows[1], CHUNK, "nearest")) / 2
            + U32 * np.abs(server)
            + roundtrip_bound(server, CHUNK, "nearest")
        )
        exact = _exact(local, step)
        err = np.abs(result.astype(np.float64) - exact)
        assert (err <= bound).all(), float((err / bound).max())
        row = hooked[0]["uint8"]["rows"][step]
        assert row["audit_max_abs"] <= bound.max()
        assert row["audit_rel_l2"] <= np.linalg.norm(bound) / np.linalg.norm(exact)
        assert row["audit_effective_bits"] == pytest.approx(-math.log2(row["audit_rel_l2"]), rel=1e-12)


def test_wrapper_audit_sample_reaches_the_audit(hooked: list[dict]) -> None:
    for rank in hooked:
        sampled, whole = rank["sample 256"], rank["sample None"]
        for a, b in zip(sampled["grads"], whole["grads"], strict=True):
            assert torch.equal(a, b)  # the sample size changes what is measured, never the gradients
        assert [r["audit_numel"] for r in whole["rows"]] == [768] * STEPS
        local = [hooked[0]["sample 256"]["local"], hooked[1]["sample 256"]["local"]]
        for step, row in enumerate(sampled["rows"]):
            # 128 elements of each rank's shard of 384, the window moving on at each visit of the bucket
            offset = 128 * step
            assert (row["audit_numel"], row["audit_sample_length"], row["audit_sample_count"]) == (256, 128, 2)
            assert (row["audit_sample_stride"], row["audit_sample_offset"]) == (384, offset)
            taken = np.r_[offset : offset + 128, 384 + offset : 384 + offset + 128]
            exact = _exact(local, step)[taken]
            result = sampled["grads"][step].double().numpy()[taken]
            assert row["audit_rel_l2"] == pytest.approx(_rel_l2(result, exact), rel=1e-12)


def test_bad_audit_sample_refused_on_every_rank(hooked: list[dict]) -> None:
    assert hooked[0]["errors"] == hooked[1]["errors"]
    assert [e.split(":")[0] for e in hooked[0]["errors"]] == ["ValueError", "TypeError", "TypeError"]
    assert all("audit_sample" in e for e in hooked[0]["errors"])
