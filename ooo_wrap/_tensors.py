"""Find the tensors in a module's inputs and outputs, cheaply for the common cases."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch

# PyTorch has no public pytree module; torch.utils._pytree is what torch.compile, FSDP and
# torch.export use to walk containers, and the only registry of user container types
# (register_pytree_node). This file is the only one in ooo_wrap that imports it.
from torch.utils import _pytree

__all__ = ["map_leaves", "named_tensors", "non_tensor_leaves", "tensors_in"]

_Tensor = torch.Tensor
# Values that hold no tensor: never searched, never reported.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_ATOM_BASES = (enum.Enum, torch.layout, torch.memory_format, type)


def tensors_in(value: Any, unseen: list[str] | None = None) -> list[torch.Tensor]:
    """Every tensor inside ``value``.

    Searched: tensors, tuples (named too), lists, dicts and other mappings, dataclasses,
    types registered with PyTorch's pytree (``deque``, user registrations), and the
    attributes of any other object (``SimpleNamespace``, a plain object, a Hugging Face
    cache holding a list of layer objects), up to ``_OBJECT_DEPTH`` objects deep. The type
    name of each object the search could not see into (no attributes, or objects nested
    deeper than that) is appended to ``unseen`` when given.

    A bare tensor and a flat tuple of tensors take a fast path: this runs twice per
    stage call, where ``torch.utils._pytree.tree_flatten`` alone would cost ~20 µs.
    """
    if isinstance(value, _Tensor):
        return [value]
    if type(value) is tuple:
        # A plain loop, not ``all()`` over a generator: that one builds a generator and
        # resumes it per item, several times this loop's cost on a short tuple.
        for item in value:
            if not isinstance(item, _Tensor):
                break
        else:
            return list(value)
    found: list[torch.Tensor] = []
    _collect(value, found, unseen, _OBJECT_DEPTH, set())
    return found


# How many plain objects deep the search opens attributes: enough for an object holding a
# list of objects holding tensors (a Hugging Face ``DynamicCache`` and its layers), bounded
# so an arbitrary object graph on the hot path costs a bounded walk.
_OBJECT_DEPTH = 3


def _collect(
    value: Any, found: list[torch.Tensor], unseen: list[str] | None, depth: int, seen: set[int]
) -> None:
    if isinstance(value, _Tensor):
        found.append(value)
    elif isinstance(value, _ATOMS):
        pass
    elif isinstance(value, (tuple, list)):
        for item in value:
            _collect(item, found, unseen, depth, seen)
    elif isinstance(value, Mapping):
        for item in value.values():
            _collect(item, found, unseen, depth, seen)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _collect(getattr(value, field.name), found, unseen, depth, seen)
    elif type(value) in _pytree.SUPPORTED_NODES:
        children, _ = _pytree.SUPPORTED_NODES[type(value)].flatten_fn(value)
        for item in children:
            _collect(item, found, unseen, depth, seen)
    elif isinstance(value, _ATOM_BASES) or callable(value):
        pass
    else:
        attributes = getattr(value, "__dict__", None)
        if depth > 0 and isinstance(attributes, dict):
            if id(value) in seen:
                return  # a cycle, or an object reached twice: its tensors are found once
            seen.add(id(value))
            for item in attributes.values():
                _collect(item, found, unseen, depth - 1, seen)
        elif unseen is not None:
            unseen.append(type(value).__name__)


def named_tensors(value: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` with a path such as ``output[0]['logits']``.

    PyTorch's pytree walks the containers it knows and spells the path; a dataclass or
    another mapping, which pytree leaves whole unless registered, is opened here.
    """
    found: list[tuple[str, torch.Tensor]] = []
    for path, leaf in _pytree.tree_flatten_with_path(value)[0]:
        where = name + _pytree.keystr(path)
        if isinstance(leaf, torch.Tensor):
            found.append((where, leaf))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                found += named_tensors(getattr(leaf, field.name), f"{where}.{field.name}")
        elif isinstance(leaf, Mapping):
            for key, item in leaf.items():
                found += named_tensors(item, f"{where}[{key!r}]")
    return found


def non_tensor_leaves(value: Any, name: str) -> list[str]:
    """``"output[1]['lr'] (float)"`` for each leaf of ``value``'s containers that is
    neither a tensor nor ``None``."""
    return [
        f"{name}{_pytree.keystr(path)} ({type(leaf).__name__})"
        for path, leaf in _pytree.tree_flatten_with_path(value)[0]
        if leaf is not None and not isinstance(leaf, torch.Tensor)
    ]


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to each leaf of its containers, rebuilt alike."""
    return _pytree.tree_map(fn, value)
