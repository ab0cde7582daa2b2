"""Each built-in config runs, shortened, to the validation loss its header states for that length, so that the
headers cannot go stale (CPU runs are deterministic: same thread count per rank, same batches, same sums)."""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from mixprec.cli.main import main
from mixprec.lab.config import CONFIGS_DIR, builtin_configs

_QUICK = re.compile(r"^# Quick check: (?P<args>.*) -> final validation loss (?P<loss>\d+\.\d{4})$", re.MULTILINE)


def _quick_check(name: str) -> tuple[list[str], str]:
    with open(os.path.join(CONFIGS_DIR, name + ".toml")) as fh:
        match = _QUICK.search(fh.read())
    assert match, f"{name}.toml states no '# Quick check: ARGS -> final validation loss X.XXXX' line"
    return shlex.split(match["args"]), match["loss"]


@pytest.mark.parametrize("name", builtin_configs())
def test_builtin_config_gives_the_loss_its_header_states(tmp_path, one_thread, name) -> None:
    args, expected = _quick_check(name)
    out = tmp_path / name
    assert main(["train", "--config", name, "--out-dir", str(out), "--no-progress", *args]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert f"{summary['final_eval_loss']:.4f}" == expected
