"""The package graph of docs/architecture.md, checked on the source: imports point one way, no private reach-ins.

Every ``import``/``from ... import`` in ``src/mixprec`` (function-level ones included, and
``importlib.import_module("mixprec...")`` strings) is read with :mod:`ast`. A module may import its own
package and packages on a lower layer, never a sibling or a higher layer, and never a private (``_name``)
module or name of another package. Two more rules of the same page: only the modules in COLLECTIVE_CALLERS call
a torch.distributed collective themselves, and no file is over MAX_FILE_LINES nor any function over
MAX_FUNCTION_LINES unless SIZE_ALLOWLIST says why.
"""

from __future__ import annotations

import ast
import fnmatch
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


# ------------------------------------------------------------------------------------------------ collectives
# Patterns are paths under src/mixprec; "**" stands for any number of folders (none included), "*" for part of one
# name, so an entry keeps matching when its module moves into a subpackage (lab/audit.py -> lab/studies/audit.py).


def _matches(rel: str, pattern: str) -> bool:
    """Whether the posix path ``rel`` matches ``pattern``, segment by segment ("**": zero or more segments)."""

    def walk(parts: list[str], pats: list[str]) -> bool:
        if not pats:
            return not parts
        if pats[0] == "**":
            return any(walk(parts[i:], pats[1:]) for i in range(len(parts) + 1))
        return bool(parts) and fnmatch.fnmatchcase(parts[0], pats[0]) and walk(parts[1:], pats[1:])

    return walk(rel.split("/"), pattern.split("/"))


# Every torch.distributed operation that all ranks of a group must enter: data and object collectives, barriers
# and point-to-point (module functions, and the methods of a ProcessGroup whose names say nothing else).
COLLECTIVES = frozenset(
    {
        "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_gather_single",
        "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
        "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "monitored_barrier",
        "recv", "recv_object_list", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
        "scatter", "scatter_object_list", "send", "send_object_list", "_all_gather_base", "_broadcast_coalesced",
        "_reduce_scatter_base", "P2POp",
    }
)  # fmt: skip
PROCESS_GROUP_METHODS = frozenset(
    {
        "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "_allgather_base", "allreduce",
        "allreduce_coalesced", "alltoall", "alltoall_base", "recv_anysource", "reduce_scatter_tensor_coalesced",
        "all_gather_single_coalesced", "reduce_scatter_single_coalesced",
    }
)  # fmt: skip
COLLECTIVE_MODULES = ("torch.distributed._functional_collectives", "torch.distributed.nn")

# The one list of modules that may call a torch.distributed collective themselves, each with its reason
# (docs/architecture.md states the rule). Everything else reaches the wire through mixprec.comm: the
# fp32-accumulating collectives, compat.all_gather_flat / reduce_scatter_flat (the backend's own, under the name
# this torch release has), objects.gather_objects / all_reduce_sum_fp64, agree.agree_any.
COLLECTIVE_CALLERS: dict[str, str] = {
    "comm/**": "the collectives layer",
    "compress/flat.py": "the compressed wire's pipeline: its all-to-all of codes and scales",
    "compress/auto.py": "the auto reducer's link probe (a timed all-reduce between barriers), rank 0's costs broadcast",
    "parallel/reducers.py": "the native reducer is the backend's own all-reduce / reduce-scatter, by definition",
    "parallel/ddp.py": "rank 0's parameters broadcast at construction; the same-model check (all_gather_object)",
    "parallel/zero.py": "the global grad norm (one fp32 all-reduce), the checkpoint's gather and its key names",
    "scaling/base.py": "overflow culprits all-gathered by name (all_gather_object)",
    "testing/**": "the harness's barrier right after init_process_group (gloo's handshake)",
    "lab/**/launch.py": "under torchrun, barriers around rank 0's preparation of the run directory",
    "lab/**/audit.py": "the collective audit measures the backend's own all-reduce and reduce-scatter",
}


def _distributed_aliases(tree: ast.AST) -> tuple[set[str], set[str]]:
    """(names bound to the torch.distributed module, names bound to collectives imported from it)."""
    modules: set[str] = set()
    functions: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    modules.add(alias.asname or "distributed")
                elif node.module in ("torch.distributed", "torch.distributed.distributed_c10d") and (
                    alias.name in COLLECTIVES
                ):
                    functions.add(alias.asname or alias.name)
    return modules, functions


def _is_distributed_module(node: ast.AST, modules: set[str]) -> bool:
    """``dist`` (an alias), ``torch.distributed`` or ``torch.distributed.distributed_c10d``."""
    if isinstance(node, ast.Name):
        return node.id in modules
    if isinstance(node, ast.Attribute) and node.attr in ("distributed", "distributed_c10d"):
        return _is_distributed_module(node.value, modules) or (
            isinstance(node.value, ast.Name) and node.value.id == "torch"
        )
    return False


def _collective_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every reference to a torch.distributed collective: ``dist.all_reduce`` (called or not),
    ``getattr(dist, "reduce_scatter_single")``, a collective imported by name, a ProcessGroup's ``allreduce``,
    an import of torch's functional collectives."""
    modules, functions = _distributed_aliases(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in COLLECTIVES and _is_distributed_module(node.value, modules):
                found.append((node.lineno, f"torch.distributed.{node.attr}"))
            elif node.attr in PROCESS_GROUP_METHODS:
                found.append((node.lineno, f"ProcessGroup.{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in functions and isinstance(node.ctx, ast.Load):
            found.append((node.lineno, f"torch.distributed.{node.id}"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and _is_distributed_module(node.args[0], modules)
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in COLLECTIVES
        ):
            found.append((node.lineno, f"torch.distributed.{node.args[1].value}"))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            for name in names:
                if any(name == m or name.startswith(m + ".") for m in COLLECTIVE_MODULES):
                    found.append((node.lineno, f"import {name}"))
    return sorted(set(found))


def _collective_callers(root: Path) -> dict[str, list[tuple[int, str]]]:
    """Every module under ``root`` that references a collective, with its references."""
    callers: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(root.rglob("*.py")):
        uses = _collective_uses(ast.parse(path.read_text(), str(path)))
        if uses:
            callers[path.relative_to(root).as_posix()] = uses
    return callers


def _collective_violations(root: Path) -> list[str]:
    problems = []
    callers = _collective_callers(root)
    for rel, uses in callers.items():
        if not any(_matches(rel, pattern) for pattern in COLLECTIVE_CALLERS):
            where = ", ".join(f"{line}: {what}" for line, what in uses)
            problems.append(
                f"{rel} calls torch.distributed collectives ({where}): go through mixprec.comm, or add the module "
                "to COLLECTIVE_CALLERS in tests/test_architecture.py with its reason"
            )
    for pattern in COLLECTIVE_CALLERS:
        if not any(_matches(rel, pattern) for rel in callers):
            problems.append(f"COLLECTIVE_CALLERS[{pattern!r}] matches no module that calls a collective: remove it")
    return problems


def test_only_the_listed_modules_call_torch_distributed_collectives() -> None:
    problems = _collective_violations(SRC)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.all_reduce(x)\n",
        "import torch.distributed as d2\nf = d2.barrier\n",
        "import torch\ntorch.distributed.broadcast(x, 0)\n",
        "from torch import distributed\ndistributed.send(x, 1)\n",
        "from torch.distributed import all_gather_object as ago\nago(out, obj)\n",
        "import torch.distributed as dist\nrs = getattr(dist, 'reduce_scatter_single', None)\n",
        "import torch.distributed as dist\ndist.distributed_c10d.gather_object(obj)\n",
        "def f(pg, t):\n    return pg.allreduce([t])\n",
        "import torch.distributed._functional_collectives as funcol\n",
    ],
)
def test_the_collective_checker_catches_each_form(tmp_path, source) -> None:
    """Not vacuous: each way of reaching a collective is reported outside the list, and allowed in comm/."""
    for where, allowed in (("parallel/x.py", False), ("comm/x.py", True)):
        target = tmp_path / where
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
        problems = [p for p in _collective_violations(tmp_path) if not p.startswith("COLLECTIVE_CALLERS")]
        assert bool(problems) != allowed, (where, problems)
        target.unlink()


def test_the_collective_checker_leaves_lookalikes_alone(tmp_path) -> None:
    """A reducer's own ``all_reduce`` method, ``ProcessGroup`` and a comment or docstring are not collectives."""
    target = tmp_path / "parallel" / "x.py"
    target.parent.mkdir(parents=True)
    target.write_text(
        "from torch.distributed import ProcessGroup\nimport torch.distributed as dist\n"
        '"""dist.all_reduce in a docstring"""\n'
        "def f(reducer, pg: ProcessGroup):  # dist.barrier() in a comment\n"
        "    dist.get_world_size(pg)\n    return reducer.all_reduce(1), reducer.reduce_scatter(2)\n"
    )
    assert _collective_callers(tmp_path) == {}


def test_collective_patterns_survive_a_move_into_a_subpackage() -> None:
    assert _matches("lab/audit.py", "lab/**/audit.py") and _matches("lab/studies/audit.py", "lab/**/audit.py")
    assert not _matches("lab/live_audit.py", "lab/**/audit.py") and not _matches("comm/x.py", "lab/**/audit.py")
    assert _matches("comm/a/b.py", "comm/**") and not _matches("compress/flat_x.py", "compress/flat.py")


# ------------------------------------------------------------------------------------------------ sizes
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80  # from the ``def`` line to the last line of the body, docstring and nested functions included

# What may stay over the limits, each with its reason. Keys: a file pattern (as in COLLECTIVE_CALLERS) for a
# file, "pattern::Qualified.name" for a function. An entry that is no longer over its limit fails the test below:
# delete it.
SIZE_ALLOWLIST: dict[str, str] = {
    "native/triton_kernels.py::quant_encode_kernel": (
        "one @triton.jit kernel is one launch's code (Triton inlines jit helpers anyway): a split changes nothing "
        "the CPU suite can check, and its tests need a GPU"
    ),
}


def _functions(tree: ast.AST) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method, nested ones included."""
    found: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if not isinstance(child, ast.ClassDef):
                    found.append((prefix + child.name, child.end_lineno - child.lineno + 1))
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def _oversized(root: Path) -> dict[str, int]:
    """Lines of everything over the limits, keyed "file" or "file::function"."""
    over: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            over[rel] = len(text.splitlines())
        for name, lines in _functions(ast.parse(text, str(path))):
            if lines > MAX_FUNCTION_LINES:
                over[f"{rel}::{name}"] = lines
    return over


def _allowed(key: str, entry: str) -> bool:
    file_key, _, func_key = key.partition("::")
    file_entry, _, func_entry = entry.partition("::")
    return func_key == func_entry and _matches(file_key, file_entry)


def _size_violations(root: Path) -> list[str]:
    over = _oversized(root)
    problems = [
        f"{key}: {lines} lines (limit {MAX_FUNCTION_LINES if '::' in key else MAX_FILE_LINES}): split it, or add it to "
        "SIZE_ALLOWLIST in tests/test_architecture.py with its reason"
        for key, lines in over.items()
        if not any(_allowed(key, entry) for entry in SIZE_ALLOWLIST)
    ]
    problems += [
        f"SIZE_ALLOWLIST[{entry!r}] is within the limits now (or gone): remove it"
        for entry in SIZE_ALLOWLIST
        if not any(_allowed(key, entry) for key in over)
    ]
    return problems


def test_no_file_or_function_is_over_its_size_limit_unless_listed() -> None:
    problems = _size_violations(SRC)
    assert not problems, "\n".join(problems)


def test_the_size_checker_counts_files_and_nested_functions(tmp_path, monkeypatch) -> None:
    """Not vacuous: a long file, a long method and a long nested function are each reported once."""
    body = "        x = 1\n" * MAX_FUNCTION_LINES  # 80 lines under a def: 81 in all
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("y = 0\n" * (MAX_FILE_LINES + 1))
    (tmp_path / "pkg" / "m.py").write_text("class C:\n    def f(self):\n" + body)
    (tmp_path / "pkg" / "n.py").write_text("def outer():\n    def inner():\n" + body)
    (tmp_path / "pkg" / "ok.py").write_text("def g():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1))
    monkeypatch.setattr(__import__(__name__), "SIZE_ALLOWLIST", {"pkg/*.py::C.f": "a reason"})
    problems = _size_violations(tmp_path)
    assert sorted(p.split(":")[0] for p in problems) == ["pkg/big.py", "pkg/n.py", "pkg/n.py"], problems
    assert any("outer.inner" in p for p in problems) and not any("g:" in p for p in problems)
