"""Every script in examples/ runs as written (a fresh interpreter, as a user would start it), exits 0, and
prints what its docstring says it shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# What each example must print (besides its final "OK" line, and its own asserts).
EXPECTED: dict[str, list[str]] = {
    "loss_scaling.py": ["written-out loop: loss", "skipped steps, final loss scale", "Updater: loss"],
    "fp32_accumulate_ddp.py": [
        "identical on every rank: True",
        "DistributedDataParallel(fp32_accumulate, ZeRO-1): loss",
        "replicas identical: True",
        "torch DDP + fp32_accumulate_hook: replicas identical: True",
    ],
    "compression.py": [
        "flat compressed all-reduce: max error",
        "0.25x the bytes of an fp32 all-reduce, identical on every rank: True",
        "with it",
        "hierarchical (2 nodes x 2 ranks)",
        "DistributedDataParallel(uint8_hierarchical, error feedback): loss",
        "torch DDP + compressed_hook: replicas identical: True",
    ],
    "emulation.py": [
        "round_to: fp8_e4m3 and bf16 bit-exact with torch's casts",
        "matmul mode=fp16/16",
        "<= deterministic bound",
        "emulate_linear_layers(model, 'fp16/16'): loss",
    ],
}


def test_every_example_is_checked() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs_and_prints_what_it_claims(name: str, tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in EXPECTED[name]:
        assert text in proc.stdout, (text, proc.stdout)
    stem = name.removesuffix(".py")
    assert proc.stdout.rstrip().endswith(f"{stem} example: OK")
