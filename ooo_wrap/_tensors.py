"""Find the tensors in a module's inputs and outputs, cheaply for the common cases.

One walker (:func:`_collect`) for every question about nested values: the stage hooks'
(:func:`tensors_in`), the race checker's and ``graphed_step``'s (:func:`named_tensors`,
:func:`non_tensor_leaves`), so that what one sees the others see.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._compat import pytree_nodes

__all__ = ["map_leaves", "named_tensors", "non_tensor_leaves", "tensors_in"]

_Tensor = torch.Tensor
# Values that hold no tensor: never searched, never reported.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_ATOM_BASES = (enum.Enum, torch.layout, torch.memory_format, type)
# Containers registered with torch's pytree (``deque``, user registrations), looked up on
# the first search that gets past the fast path: type -> node with ``flatten_fn``.
_nodes: list[Mapping[type, Any]] = []


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
    value: Any,
    found: list[Any],
    unseen: list[str] | None,
    depth: int,
    seen: set[int],
    path: str | None = None,
) -> None:
    """Append each tensor in ``value`` to ``found`` (as ``(path, tensor)`` when ``path`` is
    given), and to ``unseen`` the type name of each object not searched (with ``path``:
    ``"path (type)"`` of each leaf that is not a tensor nor ``None``)."""
    if isinstance(value, _Tensor):
        found.append(value if path is None else (path, value))
    elif isinstance(value, _ATOMS):
        if path is not None and unseen is not None and value is not None:
            unseen.append(f"{path} ({type(value).__name__})")
    elif isinstance(value, (tuple, list)):
        if path is None:
            for item in value:
                _collect(item, found, unseen, depth, seen)
        else:
            fields = getattr(value, "_fields", None) if isinstance(value, tuple) else None
            for index, item in enumerate(value):
                key = f".{fields[index]}" if fields else f"[{index}]"
                _collect(item, found, unseen, depth, seen, path + key)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _collect(item, found, unseen, depth, seen, None if path is None else f"{path}[{key!r}]")
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            where = None if path is None else f"{path}.{field.name}"
            _collect(getattr(value, field.name), found, unseen, depth, seen, where)
    elif type(value) in (_nodes[0] if _nodes else _load_nodes()):
        children, _ = _nodes[0][type(value)].flatten_fn(value)
        for index, item in enumerate(children):
            _collect(item, found, unseen, depth, seen, None if path is None else f"{path}[{index}]")
    elif isinstance(value, _ATOM_BASES) or callable(value):
        if path is not None and unseen is not None:
            unseen.append(f"{path} ({type(value).__name__})")
    else:
        attributes = getattr(value, "__dict__", None)
        if depth > 0 and isinstance(attributes, dict):
            if id(value) in seen:
                return  # a cycle, or an object reached twice: its tensors are found once
            seen.add(id(value))
            for name, item in attributes.items():
                where = None if path is None else f"{path}.{name}"
                _collect(item, found, unseen, depth - 1, seen, where)
        elif unseen is not None:
            kind = type(value).__name__
            unseen.append(kind if path is None else f"{path} ({kind})")


def _load_nodes() -> Mapping[type, Any]:
    """The pytree registry, looked up once (``_compat`` warns once if torch has none)."""
    _nodes.append(pytree_nodes())
    return _nodes[0]


def named_tensors(value: Any, name: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``value`` (as :func:`tensors_in` finds them) with a path such as
    ``output[0]['logits']`` or ``output.hidden``."""
    found: list[tuple[str, torch.Tensor]] = []
    _collect(value, found, None, _OBJECT_DEPTH, set(), name)
    return found


def non_tensor_leaves(value: Any, name: str) -> list[str]:
    """``"output[1]['lr'] (float)"`` for each leaf of ``value`` (as :func:`tensors_in`
    walks it) that is neither a tensor nor ``None``."""
    others: list[str] = []
    _collect(value, [], others, _OBJECT_DEPTH, set(), name)
    return others


def map_leaves(fn: Callable[[Any], Any], value: Any) -> Any:
    """``value`` with ``fn`` applied to each leaf of its containers (tuples, named too,
    lists, dicts, dataclasses, pytree-registered types), rebuilt alike; any other object
    is a leaf."""
    if isinstance(value, (_Tensor, *_ATOMS)):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [map_leaves(fn, item) for item in value]
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        rebuilt_dict = copy.copy(value)  # its kind kept: OrderedDict, defaultdict's factory
        for key, item in value.items():
            rebuilt_dict[key] = map_leaves(fn, item)
        return rebuilt_dict
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        rebuilt = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(rebuilt, field.name, map_leaves(fn, getattr(value, field.name)))
        return rebuilt
    node = (_nodes[0] if _nodes else _load_nodes()).get(type(value))
    if node is not None:
        children, context = node.flatten_fn(value)
        return node.unflatten_fn([map_leaves(fn, item) for item in children], context)
    return fn(value)
