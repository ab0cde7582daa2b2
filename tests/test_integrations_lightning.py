"""mixprec inside PyTorch Lightning (the real package, ``lightning`` from the integrations extra).

examples/integrations/train_lightning.py runs ``Trainer(accelerator="cpu", devices=2,
strategy=MixprecDDPStrategy("uint8", ...), plugins=[MixprecPrecision(scaler)])`` (gloo; Lightning starts the
second process): the uint8 reducer with error feedback and stochastic rounding as DDP's comm hook, mixprec's
DynamicLossScaler, an inf on rank 0 at one step. Its final parameters must be bit-equal to mixprec's own
DistributedDataParallel with the same reducer, options, seed, batches and scaler; its skips, scale and learning
rate the same (the step-interval scheduler does not advance on the skipped step).
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

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "integrations" / "train_lightning.py"


def _wrapper(rank: int, world: int, reduce: str) -> dict:
    """The same run under mixprec's own DistributedDataParallel (one scheduler step per optimizer step)."""
    return wrapper_run(load_example("train_lightning"), rank, reduce=reduce)


@pytest.mark.slow
def test_lightning_strategy_and_precision_give_the_wrappers_bits(tmp_path) -> None:
    out = tmp_path / "params.pt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replicas identical: True" in proc.stdout and "train_lightning example: OK" in proc.stdout
    got = torch.load(out, weights_only=True)
    want = run_distributed(_wrapper, 2, "uint8", timeout=240)[0]
    assert got["skipped"] == want["skipped"] == 1
    assert got["scale"] == want["scale"]
    assert got["lr"] == want["lr"] == 0.5 / 4  # three scheduler steps in four iterations
    assert torch.equal(got["weight"], want["weight"])


def test_strategy_and_plugin_refuse_what_they_cannot_run() -> None:
    from mixprec.integrations.lightning import MixprecDDPStrategy, MixprecPrecision

    with pytest.raises(ValueError, match="unknown reducer 'uint4'"):
        MixprecDDPStrategy("uint4")
    with pytest.raises(TypeError, match="reducer name or a BucketReducer"):
        MixprecDDPStrategy(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="would replace the mixprec reducer hook"):
        MixprecDDPStrategy("uint8", strategy_options={"ddp_comm_hook": print})
    with pytest.raises(TypeError, match="MixedPrecision plugin"):
        MixprecPrecision(torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="autocast_dtype"):
        MixprecPrecision(autocast_dtype=torch.float64)
