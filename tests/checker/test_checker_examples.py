"""The examples pass check(): no races, no allocator hazards, bitwise parity."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ooo_wrap.testing import check

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"ooo_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["quickstart", "transformer"])
def test_example_passes_check(name: str) -> None:
    example = _load(name)
    model = example.build_model()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    report = check(model, example.example_input(), steps=2)
    assert report.ok, str(report)
    side_backward = sum(row.backward for row in report.ops if row.stream != "default")
    assert side_backward > 0, "stages should run their backward on side streams"
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before), "caller's model changed"
