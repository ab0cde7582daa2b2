"""The package graph of docs/architecture.md, checked on the source: imports point one way, no private reach-ins.

Every ``import``/``from ... import`` in ``src/mixprec`` (function-level ones included, and
``importlib.import_module("mixprec...")`` strings) is read with :mod:`ast`. A module may import its own
package and packages on a lower layer, never a sibling or a higher layer, and never a private (``_name``)
module or name of another package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mixprec

SRC = Path(mixprec.__file__).parent

# Lower number = lower layer. Packages on one layer are siblings and must not import each other.
LAYERS = {
    "native": 0,
    "core": 1,
    "comm": 2,
    "scaling": 3,
    "emulate": 3,
    "testing": 3,
    "parallel": 4,
    "compress": 4,
    "kernels": 4,
    "integrations": 5,
    "hooks": 6,
    "fsdp": 6,
    "lab": 7,
    "cli": 8,
}


def _package_of(path: Path) -> str:
    rel = path.relative_to(SRC)
    first = rel.parts[0]
    return first[:-3] if first.endswith(".py") else first


def _imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) for every mixprec import in the tree, nested ones included."""
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "mixprec" or node.module.startswith("mixprec."):
                found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("mixprec."):
                    found.append((node.lineno, alias.name, []))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.startswith("mixprec.")
        ):
            found.append((node.lineno, node.args[0].value, []))
    return found


def _violations() -> list[str]:
    problems: list[str] = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if rel.parts[0] in ("__init__.py", "__main__.py"):
            continue  # the front door re-exports the public names of every package
        here = _package_of(path)
        if here not in LAYERS:
            problems.append(f"{rel}: package {here!r} has no layer in docs/architecture.md")
            continue
        for line, module, names in _imports(ast.parse(path.read_text(), str(path))):
            parts = module.split(".")
            if len(parts) == 1:  # `from mixprec import ...`
                if here != "cli" or any(n != "__version__" for n in names):
                    problems.append(f"{rel}:{line}: imports the top-level package (use the defining subpackage)")
                continue
            there = parts[1]
            if there == here:
                continue
            if there not in LAYERS:
                problems.append(f"{rel}:{line}: imports unknown package mixprec.{there}")
            elif LAYERS[there] >= LAYERS[here]:
                problems.append(f"{rel}:{line}: {here} (layer {LAYERS[here]}) imports {module} (layer {LAYERS[there]})")
            if any(p.startswith("_") for p in parts[2:]):
                problems.append(f"{rel}:{line}: imports the private module {module} of another package")
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                problems.append(f"{rel}:{line}: imports private names {private} from {module}")
    return problems


def test_imports_point_one_way_and_never_reach_into_privates() -> None:
    problems = _violations()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("here", "source", "expected"),
    [
        ("comm/x.py", "from mixprec.parallel.ddp import DistributedDataParallel\n", "layer"),
        ("parallel/x.py", "from mixprec.compress.quantize import MinMaxUInt8\n", "layer"),
        ("lab/x.py", "from mixprec.emulate.matmul import _matmul_model\n", "private names"),
        ("lab/x.py", "from mixprec.comm._impl import f\n", "private module"),
        ("comm/x.py", "def f():\n    import importlib\n    importlib.import_module('mixprec.compress')\n", "layer"),
        ("scaling/x.py", "from mixprec import DistributedDataParallel\n", "top-level"),
    ],
)
def test_the_checker_catches_each_kind_of_violation(tmp_path, monkeypatch, here, source, expected) -> None:
    """Not vacuous: a planted import of each forbidden kind is reported."""
    root = tmp_path / "mixprec"
    target = root / here
    target.parent.mkdir(parents=True)
    target.write_text(source)
    monkeypatch.setattr(__import__(__name__), "SRC", root)
    problems = _violations()
    assert len(problems) == 1 and expected in problems[0], problems
