"""The compressed reducer's names: ``CompressedReducer`` / ``CompressionOptions`` (every wire) and
``mixprec.comm.Topology``; the old ``mixprec.compress`` names are deprecated aliases that warn."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import mixprec.comm
import mixprec.compress
from mixprec.comm.topology import Topology
from mixprec.compress.options import CompressionOptions
from mixprec.compress.reducers import CompressedReducer

SRC = Path(__file__).resolve().parents[1] / "src" / "mixprec"

DEPRECATED = {
    "Uint8Reducer": (CompressedReducer, "mixprec.compress.CompressedReducer"),
    "Uint8Options": (CompressionOptions, "mixprec.compress.CompressionOptions"),
    "Topology": (Topology, "mixprec.comm.Topology"),
}


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_old_name_warns_and_is_the_same_object(old: str) -> None:
    new, path = DEPRECATED[old]
    with pytest.warns(DeprecationWarning, match=rf"mixprec\.compress\.{old} is deprecated.*use {path}"):
        alias = getattr(mixprec.compress, old)
    assert alias is new
    with pytest.warns(DeprecationWarning) as record:
        exec(f"from mixprec.compress import {old} as imported", namespace := {})  # the import statement, too
    assert namespace["imported"] is new
    assert record[0].filename == "<string>"  # the warning points at the importing line, not at mixprec
    assert old not in mixprec.compress.__all__ and old in dir(mixprec.compress)


def test_new_names_are_public_and_unknown_names_still_fail() -> None:
    assert {"CompressedReducer", "CompressionOptions"} <= set(mixprec.compress.__all__)
    assert "Topology" in mixprec.comm.__all__ and mixprec.comm.Topology is Topology
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from mixprec.compress import *", {})  # names no deprecated alias
    with pytest.raises(AttributeError, match="no attribute 'Uint16Reducer'"):
        mixprec.compress.Uint16Reducer  # noqa: B018


def test_nothing_inside_mixprec_uses_a_deprecated_name() -> None:
    """Every mixprec module imported and reducers of each kind built and modelled
    with DeprecationWarning an error: none of it goes through an old alias."""
    script = textwrap.dedent(
        """
        import importlib, pkgutil
        import torch
        import mixprec
        for info in pkgutil.walk_packages(mixprec.__path__, "mixprec."):
            if info.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(info.name)
            except ImportError:  # optional dependencies (triton)
                pass
        from mixprec.comm import make_reducer
        rows = torch.randn(2, 256)
        for name in ("uint8", "fp8", "auto"):
            make_reducer(name, **({"link_gbps": 1.0} if name == "auto" else {})).model(rows, average=True)
        make_reducer("uint8_hierarchical", topology=mixprec.comm.Topology(1, 2)).model(rows, average=True)
        print("clean")
        """
    )
    run = subprocess.run(
        [sys.executable, "-W", "error::DeprecationWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and run.stdout.strip() == "clean", run.stderr[-3000:]


def test_no_module_names_an_old_alias_in_code() -> None:
    # The static half of the check above, so modules that the script cannot import are covered too: no
    # identifier, attribute or import of an old name anywhere but the alias table (docstrings may say "formerly").
    old = {"Uint8Reducer", "Uint8Options"}
    hits = []
    for path in SRC.rglob("*.py"):
        if path == SRC / "compress" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.id]
                if isinstance(node, ast.Name)
                else [node.attr]
                if isinstance(node, ast.Attribute)
                else [a.name for a in node.names if node.module == "mixprec.compress" or a.name in old]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if old & set(names) or (isinstance(node, ast.ImportFrom) and "Topology" in names):
                hits.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not hits, hits
