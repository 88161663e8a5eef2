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


@pytest.fixture(autouse=True)
def _no_tuning_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes the user's tuning cache (tests of the cache set their own)."""
    monkeypatch.setenv("OOO_WRAP_CACHE", "off")
