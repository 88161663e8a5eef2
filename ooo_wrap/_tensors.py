"""Find the tensors in a module's inputs and outputs, cheaply for the common cases."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["tensors_in"]

_Tensor = torch.Tensor


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value``: tensors, tuples (named too), lists, dicts, dataclasses.

    A bare tensor and a flat tuple of tensors take a fast path: this runs twice per
    stage call, where ``torch.utils._pytree.tree_flatten`` alone would cost ~20 µs.
    """
    if isinstance(value, _Tensor):
        return [value]
    if type(value) is tuple and all(isinstance(item, _Tensor) for item in value):
        return list(value)
    found: list[torch.Tensor] = []
    _collect(value, found)
    return found


def _collect(value: Any, found: list[torch.Tensor]) -> None:
    if isinstance(value, _Tensor):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect(item, found)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _collect(getattr(value, field.name), found)
