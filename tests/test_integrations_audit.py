"""The live numerics audit through the adapters: ``ReducerHookState(audit_every=)``, Accelerate's
``apply(..., audit_every=)``, Lightning's ``MixprecDDPStrategy(audit_every=)`` and torchtitan's
``ReduceScatterConfig(audit_every=, audit_log=)``, with the real packages on 2 gloo processes.

Each audited run must give the bits of the same run without the audit (the audit only reads the buckets),
and its rows must reach the documented place (``state.audit_rows``, ``accelerator.log``, the Lightning
logger, the torchtitan audit log) with errors inside the reducer's bound: fp32 parameters reduced by
fp32_accumulate on 2 ranks are one fp32 addition (a + b rounded once, u = 2^-24 relative to the exact sum,
Higham's gamma_1) and an exact halving, so rel_l2 and max_rel <= 2^-24; a bf16 reduce-scatter rounds the
fp32 sum once to bf16 (u = 2^-8) after an fp32 sum whose share stays far below it here.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mixprec.testing import run_distributed

ROOT = Path(__file__).resolve().parents[1]
RUNS = Path(__file__).resolve().with_name("adapter_audit_runs.py")
U_FP32 = 2.0**-24
U_BF16 = 2.0**-8


@pytest.fixture(autouse=True, scope="module")
def _import_before_forking() -> None:
    importlib.import_module("torch._dynamo")  # torch DDP imports it: once here, not in every forked rank


def _check_rows(rows: list[dict], *, steps: list[int], bound: float, native: bool) -> None:
    assert [int(float(r["audit_step"])) for r in rows] == steps
    for r in rows:
        rel, max_rel = float(r["audit_rel_l2"]), float(r["audit_max_rel"])
        assert 0.0 <= rel <= bound and max_rel <= bound, r
        assert float(r["audit_effective_bits"]) >= -math.log2(bound) - 1e-9
        assert int(float(r["audit_numel"])) > 0 and int(float(r["audit_nonfinite_results"])) == 0
        assert ("audit_native_rel_l2" in r) == native


# ---------------------------------------------------------------------- ReducerHookState under torch DDP
def _hook_case(rank: int, world: int, reduce: str, sample: int | None) -> dict:
    from mixprec.integrations.ddp_reducer import ReducerHookState, reducer_hook

    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    out: dict = {}
    for audited in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5))
        ddp = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)  # several buckets
        seen: list = []
        options = {"audit_every": 2, "on_audit": seen.append} if audited else {}
        state = ReducerHookState(reduce, **options)
        if sample is not None:
            state.audit.sample = sample
        ddp.register_comm_hook(state, reducer_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(6):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()
        out[audited] = [p.detach().clone() for p in net.parameters()]
        if audited:
            out["rows"] = state.audit_rows
            out["seen"] = [r.as_row() for r in seen]
    return out


@pytest.mark.parametrize(("reduce", "sample"), [("fp32_accumulate", None), ("fp32_accumulate", 64), ("native", None)])
def test_reducer_hook_audit_changes_no_bit_and_bounds_the_error(reduce: str, sample: int | None) -> None:
    out = run_distributed(_hook_case, 2, reduce, sample, timeout=180)
    for r in out:
        assert all(torch.equal(a, b) for a, b in zip(r[False], r[True], strict=True))
        assert r["rows"] == r["seen"]  # on_audit got each row as it was recorded
        _check_rows(r["rows"], steps=[2, 4, 6], bound=U_FP32, native=reduce != "native")
        if sample is not None:  # the first layer's weight (384 elements) is sampled: 32 per shard
            big = [row for row in r["rows"] if row["audit_bucket_numel"] > sample]
            assert big and all(row["audit_numel"] == 64 and row["audit_sample_count"] == 2 for row in big)
    assert out[0]["rows"][0]["audit_rel_l2"] == out[1]["rows"][0]["audit_rel_l2"]  # identical reduced bits


# ---------------------------------------------------------------------- Accelerate and Lightning
def _run(tmp_path: Path, adapter: str, audit_every: int | None) -> dict:
    out = tmp_path / f"{adapter}_{audit_every}.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    launch = [sys.executable]
    if adapter == "accelerate":
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = [str(RUNS), adapter, "--out", str(out)]
    if audit_every is not None:
        args += ["--audit-every", str(audit_every)]
    proc = subprocess.run(launch + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out, weights_only=False)


def _wrapper(rank: int, world: int, adapter: str) -> dict:
    """The example's run under mixprec's own wrapper, without the audit (Accelerate's prepared scheduler steps
    once per process per optimizer step)."""
    from integration_reference import load_example, wrapper_run

    example = load_example(f"train_{adapter}")
    return wrapper_run(example, rank, reduce="fp32_accumulate", schedule_steps=world if adapter == "accelerate" else 1)


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["accelerate", "lightning"])
def test_adapter_audit_rows_reach_its_logger_and_change_no_bit(tmp_path, adapter: str) -> None:
    pytest.importorskip(adapter)
    audited = _run(tmp_path, adapter, 1)
    # The unaudited reference: mixprec's wrapper, which the adapters match bit for bit without the audit
    # (tests/test_integrations_accelerate.py, tests/test_integrations_lightning.py).
    plain = run_distributed(_wrapper, 2, adapter, timeout=240)[0]
    assert torch.equal(plain["weight"], audited["weight"])
    rows = audited["rows"]  # what the tracker (accelerator.log) or Lightning's CSV logger received
    # Four steps, each audited; step 3 holds rank 0's inf (examples' INF_STEP): left out of the metrics, counted.
    _check_rows(rows, steps=[1, 2, 3, 4], bound=U_FP32, native=True)
    assert [int(float(r["audit_nonfinite_inputs"])) > 0 for r in rows] == [False, False, True, False]
    for logged, kept in zip(rows, audited["state_rows"], strict=True):
        assert float(logged["audit_rel_l2"]) == kept["audit_rel_l2"]


# ---------------------------------------------------------------------- torchtitan
def _titan(rank: int, world: int, config) -> list[torch.Tensor]:
    path = ROOT / "examples" / "integrations" / "train_torchtitan.py"
    spec = importlib.util.spec_from_file_location("train_torchtitan", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.train(rank, world, "wrapped", config)


@pytest.mark.slow
def test_torchtitan_config_audits_into_its_log(tmp_path) -> None:
    from mixprec.integrations.torchtitan import ReduceScatterConfig

    importlib.import_module("torch.distributed.fsdp")
    log = tmp_path / "audit.jsonl"
    plain = run_distributed(_titan, 2, ReduceScatterConfig(device="cpu"), timeout=180)[0]
    config = ReduceScatterConfig.from_dict({"device": "cpu", "audit_every": 1, "audit_log": str(log)})
    audited = run_distributed(_titan, 2, config, timeout=180)[0]
    assert all(torch.equal(a, b) for a, b in zip(plain, audited, strict=True))
    rows = [json.loads(line) for line in log.read_text().splitlines()]  # rank 0's only
    _check_rows(rows, steps=[1, 2, 3], bound=1.5 * U_BF16, native=True)
    assert all(r["audit_wire_dtype"] == "bfloat16" for r in rows)


def test_audit_options_are_checked() -> None:
    from mixprec.integrations.torchtitan import ReduceScatterConfig

    with pytest.raises(ValueError, match="audit_every must be an int >= 1"):
        ReduceScatterConfig(audit_every=0)
    with pytest.raises(ValueError, match="audit_log applies only with audit_every"):
        ReduceScatterConfig(audit_log="a.jsonl")
    lightning = pytest.importorskip("lightning")
    assert lightning
    from mixprec.integrations.lightning import MixprecDDPStrategy

    with pytest.raises(TypeError, match="audit_every must be an int"):
        MixprecDDPStrategy(audit_every="100")


def _fsdp2_accelerate(rank: int, world: int) -> list[dict]:
    """Accelerate's FSDP2 branch of apply() with audit_every on real fully_shard-ed modules (Accelerate routes
    cpu=True to DDP, so the accelerator's attributes apply() reads are given by hand, log() included)."""
    import accelerate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mixprec.integrations import accelerate as adapter

    logged: list[dict] = []

    class FSDP2Accelerator:
        distributed_type = accelerate.utils.DistributedType.FSDP
        is_fsdp2 = True

        def log(self, values: dict, step: int | None = None) -> None:
            logged.append({**values, "logged_step": step})

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    assert adapter.apply(FSDP2Accelerator(), model, audit_every=1) == 3
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).float().square().mean().backward()
        model.zero_grad()
    return logged


@pytest.mark.slow
def test_accelerate_fsdp2_audit_rows_go_to_accelerator_log() -> None:
    pytest.importorskip("accelerate")
    importlib.import_module("torch.distributed.fsdp")
    for rows in run_distributed(_fsdp2_accelerate, 2, timeout=180):
        _check_rows(rows, steps=[1, 2], bound=1.5 * U_BF16, native=True)
        assert [r["logged_step"] for r in rows] == [1, 2] and [r["audit_bucket"] for r in rows] == [0, 1]
        assert all(isinstance(v, int | float) for r in rows for v in r.values())  # numbers only: no wire dtype
