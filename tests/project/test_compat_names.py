"""Every private PyTorch name ooo_wrap reads is on the installed torch, and none is needed
to import ooo_wrap, wrap a model or train it.

The names come from ``ooo_wrap._compat.PRIVATE_NAMES``, so this list cannot drift from what
the library reads. Each is hidden from a fresh process before ``import ooo_wrap`` (deleted
from its module or class), which then imports the library, wraps and trains models, copies,
checks and checkpoints them: everything must still work, with exactly one warning naming
the hidden name.
"""

from __future__ import annotations

import json
import os
import pathlib
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
