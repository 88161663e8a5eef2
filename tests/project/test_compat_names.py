"""Every private PyTorch name ooo_wrap reads is on the installed torch, and none is needed
to import ooo_wrap, wrap a model or train it.

The names come from ``ooo_wrap._compat.PRIVATE_NAMES``, so this list cannot drift from what
the library reads. Each is hidden from a fresh process before ``import ooo_wrap`` (deleted
from its module or class), which then imports the library, wraps and trains models, copies,
checks and checkpoints them: everything must still work, with exactly one warning naming
the hidden name.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from ooo_wrap import _compat

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCENARIO = pathlib.Path(__file__).resolve().parent / "compat_scenario.py"
PATHS = [name.path for name in _compat.PRIVATE_NAMES]
# The names whose absence makes every model run plain, and the race checker's.
PLAIN = {n.path for n in _compat.PRIVATE_NAMES if n.without.startswith("wrapped models run plain")}
CHECKER = {n.path for n in _compat.PRIVATE_NAMES if "race checker" in n.without}


def test_every_private_name_is_on_this_torch() -> None:
    # On the supported torch every guard finds its name: a rename fails here, loudly.
    missing = [path for path in PATHS if _compat.private(path) is None]
    assert missing == [], f"this torch ({torch.__version__}) lacks {missing}"


def test_the_names_torch_itself_reads_on_instances_are_there() -> None:
    # What no test can hide from a running torch (torch reads them itself): still checked.
    module = nn.Linear(2, 2)
    handle = module.register_forward_hook(lambda *args: None, with_kwargs=True)
    assert len(_compat.forward_hook_dicts(module)) == 5
    assert isinstance(vars(module)[_compat.MODULE_CHILDREN_KEY], dict)
    main, extra = _compat.handle_dicts(handle)
    assert main is not None and handle.id in main and any(handle.id in d for d in extra)
    assert _compat.next_hook_id() > handle.id
    assert len(_compat.hook_dicts(module)) >= 5
    assert _compat.op_schema(torch.ops.aten.mm.default).name == "aten::mm"
    assert _compat.tensor_version(torch.ones(1).add_(1)) == 1
    assert _compat.module_calls_visible()
    handle.remove()


def _run(hidden: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(SCENARIO), *hidden],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_nothing_hidden_means_no_warning_and_streams() -> None:
    result = _run([])
    assert result["warnings"] == []
    assert result["check"] == "ok"
    assert "disabled/unsupported_torch" not in result["events"]


def test_all_hidden_at_once_still_imports_wraps_and_trains() -> None:
    result = _run(PATHS)
    warned = result["warnings"]
    assert isinstance(warned, list)
    for message in warned:
        assert sum(path in message for path in PATHS) >= 1, message
    for path in PATHS:
        assert sum(f" {path}," in message for message in warned) <= 1, path
    assert "disabled/unsupported_torch" in result["events"]


def test_the_names_of_features_hidden_together_leave_streams_and_the_checker_on() -> None:
    # What the one-at-a-time runs (-m slow) show name by name, for every name that only
    # turns its own feature off, in one process: each warned about once, nothing else off.
    features = [path for path in PATHS if path not in PLAIN and path not in CHECKER]
    result = _run(features)
    warned = result["warnings"]
    assert isinstance(warned, list)
    assert sorted(path for path in features for m in warned if f" {path}," in m) == sorted(
        features
    ), warned
    assert len(warned) == len(features), warned
    assert "disabled/unsupported_torch" not in result["events"]
    assert result["check"] == "ok"


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_each_name_hidden_leaves_one_warning_naming_it(path: str) -> None:
    result = _run([path])
    warned = result["warnings"]
    assert isinstance(warned, list)
    assert len(warned) == 1 and f" {path}," in warned[0], warned
    streams = "disabled/unsupported_torch" not in result["events"]
    assert streams is (path not in PLAIN)
    if path in CHECKER:
        assert result["check"] == f"OOOError: {path}"
    else:
        assert result["check"] == ("not checked" if path in PLAIN else "ok")


# --- every private name _compat.py reads is listed ----------------------------------------

# Private attributes _compat.py reads on objects (not on a ``torch`` path) whose name is
# not the last part of a listed name: none is torch's.
NOT_TORCH = {
    "_target": "threading.Thread's, the thread's function (replace_thread_target)",
    "_ooo_wrap_unpacks": "ooo_wrap's own mark on a checkpoint hook class it made",
}


def _dotted(node: ast.AST) -> str | None:
    """``torch.a.b`` as ``"torch.a.b"``, ``getattr(torch.a, "b", ...)`` too; else ``None``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    if _getattr_name(node) is not None:
        assert isinstance(node, ast.Call)
        base = _dotted(node.args[0])
        return None if base is None else f"{base}.{_getattr_name(node)}"
    return None


def _getattr_name(node: ast.AST) -> str | None:
    """``"b"`` for ``getattr(x, "b", ...)``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        return None
    if node.func.id != "getattr" or len(node.args) < 2:
        return None
    name = node.args[1]
    return name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reads(source: str) -> tuple[set[str], set[str]]:
    """The private ``torch`` paths ``source`` reads (attributes, ``getattr`` with a constant
    name, imports, dotted strings such as :func:`_compat.private` takes), and the private
    attribute names it reads on other objects; ``if TYPE_CHECKING:`` blocks left out."""
    tree = ast.parse(source)
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for child in node.body
        for inner in ast.walk(child)
    }
    paths: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        found: list[str] = []
        if isinstance(node, ast.Attribute | ast.Call):
            path = _dotted(node)
            if path is not None and path.startswith("torch."):
                found.append(path)
            elif isinstance(node, ast.Attribute) and _is_private(node.attr):
                names.add(node.attr)
            elif (name := _getattr_name(node)) is not None and _is_private(name):
                names.add(name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            found += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and re.fullmatch(r"torch(\.\w+)+", str(node.value)):
            found.append(str(node.value))
        paths |= {p for p in found if any(map(_is_private, p.split(".")[1:]))}
    return paths, names


def unlisted(paths: set[str], names: set[str]) -> list[str]:
    """What :func:`private_reads` found that ``PRIVATE_NAMES`` does not list (a path on the
    way to a listed one, such as its module, counts as listed)."""
    missing = [p for p in paths if p not in PATHS and not any(q.startswith(f"{p}.") for q in PATHS)]
    last_parts = {path.rsplit(".", 1)[1] for path in PATHS}
    missing += [n for n in names if n not in last_parts and n not in NOT_TORCH]
    return sorted(missing)


def test_every_private_name_compat_reads_is_listed() -> None:
    source = pathlib.Path(_compat.__file__).read_text(encoding="utf-8")
    paths, names = private_reads(source)
    assert "torch._C._len_torch_function_stack" in paths  # it sees what it must check
    assert "_cdata" in names
    assert unlisted(paths, names) == [], (
        "list each in _compat.PRIVATE_NAMES and read it through _compat.private()"
    )


def test_the_listing_check_finds_each_way_of_reading_a_name() -> None:
    # Mutation: each way of reading an unlisted private name is caught.
    reads = {
        "getattr(torch._C, '_unlisted', None)": "torch._C._unlisted",
        "torch._C._unlisted()": "torch._C._unlisted",
        "from torch._unlisted import thing": "torch._unlisted.thing",
        "import torch._unlisted": "torch._unlisted",
        "private('torch.utils._unlisted')": "torch.utils._unlisted",
        "tensor._unlisted": "_unlisted",
        "getattr(node, '_unlisted')": "_unlisted",
    }
    for code, name in reads.items():
        assert unlisted(*private_reads(code)) == [name], code
    typing_only = "if TYPE_CHECKING:\n    from torch._unlisted import Thing\n"
    assert unlisted(*private_reads(typing_only)) == []
    listed = "torch._C._len_torch_function_stack(); torch.utils._python_dispatch"
    assert unlisted(*private_reads(listed)) == []
