"""Find the tensors in a module's inputs and outputs, cheaply for the common cases."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

import torch

# PyTorch has no public pytree module; torch.utils._pytree is what torch.compile, FSDP and
# torch.export use to walk containers, and the only registry of user container types
# (register_pytree_node). Used here only to flatten one level of a registered type.
from torch.utils import _pytree

__all__ = ["storage_tensor", "tensors_in"]

_Tensor = torch.Tensor
# Values that hold no tensor: never searched, never reported.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_ATOM_BASES = (enum.Enum, torch.layout, torch.memory_format, type)


def tensors_in(value: Any, unseen: list[str] | None = None) -> list[torch.Tensor]:
    """Every tensor inside ``value``.

    Searched: tensors, tuples (named too), lists, dicts and other mappings, dataclasses,
    types registered with PyTorch's pytree (``deque``, user registrations), and one level
    of any other object's attributes (``SimpleNamespace``, a plain object). The type name of
    each object the search could not see into (no attributes, or an object inside an
    object's attribute) is appended to ``unseen`` when given.

    A bare tensor and a flat tuple of tensors take a fast path: this runs twice per
    stage call, where ``torch.utils._pytree.tree_flatten`` alone would cost ~20 µs.
    """
    if isinstance(value, _Tensor):
        return [value]
    if type(value) is tuple and all(isinstance(item, _Tensor) for item in value):
        return list(value)
    found: list[torch.Tensor] = []
    _collect(value, found, unseen, open_objects=True)
    return found


def _collect(
    value: Any, found: list[torch.Tensor], unseen: list[str] | None, *, open_objects: bool
) -> None:
    if isinstance(value, _Tensor):
        found.append(value)
    elif isinstance(value, _ATOMS):
        pass
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found, unseen, open_objects=open_objects)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect(item, found, unseen, open_objects=open_objects)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _collect(getattr(value, field.name), found, unseen, open_objects=open_objects)
    elif type(value) in _pytree.SUPPORTED_NODES:
        children, _ = _pytree.SUPPORTED_NODES[type(value)].flatten_fn(value)
        for item in children:
            _collect(item, found, unseen, open_objects=open_objects)
    elif isinstance(value, _ATOM_BASES) or callable(value):
        pass
    else:
        attributes = getattr(value, "__dict__", None)
        if open_objects and isinstance(attributes, dict):
            # One level only: an object inside an attribute is not opened (no recursion
            # into arbitrary object graphs on the hot path); it is reported instead.
            for item in attributes.values():
                _collect(item, found, unseen, open_objects=False)
        elif unseen is not None:
            unseen.append(type(value).__name__)


def storage_tensor(tensor: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor under ``tensor``'s torch.func wrappers, or ``None`` if it has none.

    Inside ``vmap`` a tensor is a wrapper over the whole batch, and ``record_stream`` has
    no batching rule; the wrapped tensor shares the wrapper's memory, so the allocator
    mark belongs on it. torch.func has no public unwrap, hence its private helpers here.
    """
    from torch._C import _functorch

    if not _functorch.is_functorch_wrapped_tensor(tensor):
        return None
    while _functorch.is_functorch_wrapped_tensor(tensor):
        tensor = _functorch.get_unwrapped(tensor)
    return tensor
