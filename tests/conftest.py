"""Shared fixtures; tests marked ``cuda`` are skipped on machines without a CUDA device."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no cuda device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def regions_by_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner keeps every region its region rule finds, not only those the simulated
    step pays for: for tests of plan structure (which branch goes where) on small models."""
    from ooo_wrap import _dataflow

    monkeypatch.setattr(_dataflow, "BY_SIMULATION", False)
