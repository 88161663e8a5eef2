"""Every ``python`` snippet in docs/using_with_part_b.md runs, each in a fresh namespace."""

from __future__ import annotations

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "using_with_part_b.md"
SNIPPETS = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)


def test_the_page_has_snippets() -> None:
    assert len(SNIPPETS) == 3


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_snippet_runs(index: int) -> None:
    code = compile(SNIPPETS[index], f"{DOC.name}[python snippet {index}]", "exec")
    exec(code, {"__name__": f"docs_snippet_{index}"})
