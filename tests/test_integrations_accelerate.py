"""mixprec inside Hugging Face Accelerate (the real package, ``accelerate`` from the integrations extra).

examples/integrations/train_accelerate.py runs under ``torchrun --nproc-per-node 2`` (gloo, CPU): the uint8
reducer with error feedback and stochastic rounding as the DDP comm hook after ``prepare()``, mixprec's
DynamicLossScaler as the accelerator's scaler, an inf on rank 0 at one step. Its final parameters must be
bit-equal to mixprec's own DistributedDataParallel with the same reducer, options, seed, batches and
scaler, its skips, scale and learning rate the same (the prepared scheduler does not step on a skipped step).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from integration_reference import load_example, wrapper_run
from mixprec.testing import run_distributed

accelerate = pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "integrations" / "train_accelerate.py"


def _wrapper(rank: int, world: int, reduce: str, schedule_steps: int | None = None) -> dict:
    """The same run under mixprec's own DistributedDataParallel, SkipAwareLR stepping as Accelerate's
    prepared scheduler does (num_processes steps per optimizer step that ran) or ``schedule_steps`` times."""
    steps = world if schedule_steps is None else schedule_steps
    return wrapper_run(load_example("train_accelerate"), rank, reduce=reduce, schedule_steps=steps)


def _torchrun(tmp_path: Path, *args: str, script: Path = SCRIPT) -> tuple[str, dict]:
    out = tmp_path / "params.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(script),
        "--out",
        str(out),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, torch.load(out, weights_only=True)


@pytest.mark.slow
def test_accelerate_hook_and_scaler_give_the_wrappers_bits(tmp_path) -> None:
    stdout, got = _torchrun(tmp_path, "--reduce", "uint8")
    assert stdout.count("before prepare(): ValueError") == 2, stdout
    assert "replicas identical: True" in stdout and "train_accelerate example: OK" in stdout
    want = run_distributed(_wrapper, 2, "uint8", timeout=240)[0]
    assert got["skipped"] == want["skipped"] == 1
    assert got["scale"] == want["scale"]
    assert got["lr"] == want["lr"]
    assert torch.equal(got["weight"], want["weight"])


@pytest.mark.slow
def test_hf_trainer_callback_gives_the_wrappers_bits(tmp_path) -> None:
    """examples/integrations/hf_trainer_accelerate.py: the same run inside transformers' Trainer (it steps its
    scheduler once per step that ran, when accelerator.optimizer_step_was_skipped is False)."""
    pytest.importorskip("transformers")
    stdout, got = _torchrun(tmp_path, script=SCRIPT.with_name("hf_trainer_accelerate.py"))
    assert "hf_trainer_accelerate example: OK" in stdout
    want = run_distributed(_wrapper, 2, "uint8", 1, timeout=240)[0]
    assert got["skipped"] == want["skipped"] == 1
    assert got["scale"] == want["scale"]
    assert got["lr"] == want["lr"] == 0.5 / 4
    assert torch.equal(got["weight"], want["weight"])


def test_apply_refuses_what_it_cannot_hook() -> None:
    from mixprec.integrations import accelerate as adapter

    class NotAnAccelerator:
        pass

    with pytest.raises(TypeError, match=r"accelerate\.Accelerator"):
        adapter.apply(NotAnAccelerator(), torch.nn.Linear(2, 2))

    class Fake:  # the attributes apply() reads, without starting a process group
        def __init__(self, kind: str) -> None:
            self.distributed_type = accelerate.utils.DistributedType(kind)
            self.is_fsdp2 = False

    with pytest.raises(ValueError, match=r"after model = accelerator.prepare\(model\)"):
        adapter.apply(Fake("MULTI_CPU"), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="DataParallel"):
        adapter.apply(Fake("MULTI_CPU"), torch.nn.DataParallel(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="DeepSpeed"):
        adapter.apply(Fake("DEEPSPEED"), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="FSDP2 only"):
        adapter.apply(Fake("FSDP"), torch.nn.Linear(2, 2))


def _fsdp2_apply(rank: int, world: int) -> tuple[int, str]:
    """apply()'s FSDP2 branch on real fully_shard-ed modules (Accelerate routes cpu=True to DDP, so its FSDP2
    plugin cannot run here: the accelerator's two attributes that apply() reads are given by hand)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mixprec.integrations import accelerate as adapter

    class FSDP2Accelerator:
        distributed_type = accelerate.utils.DistributedType.FSDP
        is_fsdp2 = True

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        adapter.apply(FSDP2Accelerator(), model, reduce="uint8")
        refusal = ""
    except ValueError as exc:
        refusal = str(exc)
    return adapter.apply(FSDP2Accelerator(), model, rounding="stochastic"), refusal


@pytest.mark.slow
def test_apply_installs_the_reduce_scatter_on_fsdp2_modules() -> None:
    import torch._dynamo  # FSDP2 imports it on first use: once here, not per rank
    import torch.distributed.fsdp  # noqa: F401

    for installed, refusal in run_distributed(_fsdp2_apply, 2, timeout=120):
        assert installed == 2  # model[0] and the root
        assert "only 'fp32_accumulate' can" in refusal
