"""The package's modules import each other top-down: no cycle, lazy imports included.

Read from the source with ``ast``: every ``import`` of an ``ooo_wrap`` module, at module
level or inside a function, is an edge; only imports under ``if TYPE_CHECKING:`` (never run)
are left out. A cycle would mean some module is only half-initialised when another needs
it, or a function-level import that goes back up the layers.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ooo_wrap"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The ooo_wrap modules ``path`` imports (each package's ``__init__`` counts as one)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text())]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            found.update(target for target in targets if target in modules)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        stack.extend(ast.iter_child_nodes(node))
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    graph = {_module_name(path): _imports(path, modules) for path in paths}
    # Importing ``a.b`` runs ``a/__init__`` first: a package's own modules may import
    # siblings through it, so the edge from a submodule to its own package is not a layer.
    for name, targets in graph.items():
        targets -= {name.rpartition(".")[0]}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            if (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_the_check_finds_a_cycle_and_skips_type_checking_imports() -> None:
    graph = _graph()
    assert "ooo_wrap._wrapper.serialize" in graph["ooo_wrap._wrapper.module"]
    assert (
        "ooo_wrap._wrapper.module" not in graph["ooo_wrap._wrapper.serialize"]
    )  # under TYPE_CHECKING
    graph["ooo_wrap._wrapper.serialize"] = graph["ooo_wrap._wrapper.serialize"] | {
        "ooo_wrap._wrapper.module"
    }
    cycle = _cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert sorted(cycle[1:]) == ["ooo_wrap._wrapper.module", "ooo_wrap._wrapper.serialize"]
    assert "ooo_wrap.testing" in graph["ooo_wrap._cli"]  # a function-level import counts


def test_importing_the_package_imports_every_module_once() -> None:
    code = (
        "import sys, ooo_wrap\nprint(sorted(m for m in sys.modules if m.startswith('ooo_wrap')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    # -X importtime writes one line per module actually executed, to stderr.
    executed = [
        line.rsplit("|", 1)[-1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "ooo_wrap" in line.rsplit("|", 1)[-1]
    ]
    assert executed and len(executed) == len(set(executed)), executed
    assert "ooo_wrap._wrapper.serialize" in executed


def _documented_files() -> set[str]:
    """The module paths the file tree of ``docs/code-layout.md`` lists."""
    text = (PACKAGE.parent / "docs" / "code-layout.md").read_text()
    tree = text.split("## Files", 1)[1].split("```", 2)[1]
    found: set[str] = set()
    folders: list[tuple[int, str]] = []
    for line in tree.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        name = line.split()[0]
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = "/".join([*(folder for _, folder in folders), name.rstrip("/")])
        if name.endswith("/"):
            folders.append((indent, name.rstrip("/")))
        else:
            found.add(path)
    return found


def test_the_code_layout_page_lists_every_module() -> None:
    actual = {
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    documented = {path for path in _documented_files() if not path.endswith("__init__.py")}
    assert documented == actual, (
        f"missing from docs/code-layout.md: {sorted(actual - documented)}; "
        f"listed but gone: {sorted(documented - actual)}"
    )
