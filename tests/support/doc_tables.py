"""Read the docs' markdown tables, so that a test compares a command's figures with the doc's.

The doc is the single source: a test finds its table by the header row, computes each row
as the command does, and reports every cell that differs with the doc, the row, the column
and both values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# The docs whose tables the tests read: README.md and every page in docs/.
DOCS = (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")))

_FENCE = re.compile(r"^\s*```")
_DIVIDER = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(doc: Path) -> list[list[list[str]]]:
    """Every table of ``doc`` outside code blocks: rows of cells, the header first."""
    found: list[list[list[str]]] = []
    lines = doc.read_text(encoding="utf-8").splitlines()
    fenced = False
    for number, line in enumerate(lines):
        if _FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith("|") or number + 1 >= len(lines):
            continue
        starts = number == 0 or not lines[number - 1].startswith("|")
        if starts and _DIVIDER.match(lines[number + 1]):
            rows = [_cells(line)]
            for body in lines[number + 2 :]:
                if not body.startswith("|"):
                    break
                rows.append(_cells(body))
            found.append(rows)
    return found


def table(doc: Path, header: Sequence[str]) -> list[dict[str, str]]:
    """The rows of the table of ``doc`` whose header is ``header``, as column -> cell."""
    matching = [rows for rows in tables(doc) if rows[0] == list(header)]
    name = doc.relative_to(REPO_ROOT)
    assert len(matching) == 1, f"{name}: {len(matching)} tables with the header {list(header)}"
    return [dict(zip(header, row, strict=True)) for row in matching[0][1:]]


def row(doc: Path, rows: Sequence[Mapping[str, str]], column: str, key: str) -> Mapping[str, str]:
    """The one row of ``rows`` whose ``column`` contains ``key``."""
    found = [r for r in rows if key in r[column]]
    name = doc.relative_to(REPO_ROOT)
    assert len(found) == 1, f"{name}: {len(found)} rows with {key!r} in the column {column!r}"
    return found[0]


def differences(
    doc: Path, row_name: str, shown: Mapping[str, str], computed: Mapping[str, str]
) -> list[str]:
    """One line per column of ``computed`` where the doc's row ``shown`` says otherwise."""
    name = doc.relative_to(REPO_ROOT)
    return [
        f"{name}, row {row_name!r}, column {column!r}: the doc shows {shown.get(column)!r}, "
        f"the command gives {value!r}"
        for column, value in computed.items()
        if shown.get(column) != value
    ]
