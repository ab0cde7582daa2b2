"""docs/api.md lists every public name under its one import path, and nothing else; the top level stays small."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _documented() -> dict[str, set[str]]:
    listed: dict[str, set[str]] = {}
    package = None
    for line in DOC.read_text().splitlines():
        header = re.match(r"^## `([\w.]+)`", line)
        if header:
            package = header.group(1)
            listed[package] = set()
        item = re.match(r"^- `([\w]+)`", line)
        if item and package is not None:
            listed[package].add(item.group(1))
    return listed


def test_api_page_matches_every_public_package() -> None:
    listed = _documented()
    assert listed, "docs/api.md lists no package"
    for package, names in listed.items():
        exported = set(importlib.import_module(package).__all__)
        assert names == exported, (package, sorted(names - exported), sorted(exported - names))


def test_top_level_is_small_and_each_name_has_one_home() -> None:
    import mixprec

    assert len(mixprec.__all__) <= 15
    listed = _documented()
    homes: dict[str, list[str]] = {}
    for package, names in listed.items():
        if package != "mixprec":
            for name in names:
                homes.setdefault(name, []).append(package)
    shared = {name: where for name, where in homes.items() if len(where) > 1}
    assert not shared, f"names exported by more than one subpackage: {shared}"
    for name in mixprec.__all__:
        if name != "__version__":
            assert name in homes, f"top-level {name} has no home subpackage"
