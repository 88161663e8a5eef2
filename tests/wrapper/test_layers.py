"""The wrapper's modules import one way, even for annotations, and each stays readable."""

from __future__ import annotations

import ast
import pathlib

WRAPPER = pathlib.Path(__file__).resolve().parents[2] / "ooo_wrap" / "_wrapper"


def _siblings_imported(path: pathlib.Path) -> set[str]:
    """The ``_wrapper`` modules ``path`` imports, ``if TYPE_CHECKING:`` blocks included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found.add(node.module)
    return found


def test_no_wrapper_module_imports_one_that_imports_it_back() -> None:
    graph = {path.stem: _siblings_imported(path) for path in WRAPPER.glob("*.py")}
    order: list[str] = []  # each module after everything it imports

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join([*path, name])
        if name not in order:
            for target in sorted(graph[name]):
                visit(target, (*path, name))
            order.append(name)

    for name in sorted(graph):
        visit(name, ())
    assert order.index("lifecycle") > max(order.index(n) for n in ("learn", "tune", "tuning"))
    assert not any("module" in targets for targets in graph.values())  # the top


def test_every_wrapper_module_is_short_and_says_what_it_is() -> None:
    for path in WRAPPER.glob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 400, path.name
        if path.name != "__init__.py":
            assert ast.get_docstring(ast.parse(text)), path.name
