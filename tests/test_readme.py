"""Every Python block of the README is an excerpt of a script in examples/, which test_examples runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lines(text: str) -> str:
    # The README shows an excerpt dedented; inside the script it may sit in a function.
    return "\n".join(line.strip() for line in text.strip("\n").splitlines())


def test_readme_python_blocks_are_excerpts_of_tested_examples() -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert len(blocks) >= 5
    examples = [_lines(p.read_text()) for p in (ROOT / "examples").glob("*.py")]
    for block in blocks:
        assert any(_lines(block) in text for text in examples), f"not an excerpt of examples/*.py:\n{block}"
