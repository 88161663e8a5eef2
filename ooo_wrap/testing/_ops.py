"""Which storages an aten op reads, writes and allocates, from its schema."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorUse", "storage_key", "tensor_uses", "tensors_of"]

# Ops that update their running statistics in place in training mode although their
# schema does not mark those arguments as written: schema name -> (training arg, stats).
_HIDDEN_WRITES = {
    "aten::native_batch_norm": (5, (3, 4)),
    "aten::cudnn_batch_norm": (5, (3, 4)),
    "aten::miopen_batch_norm": (5, (3, 4)),
}


@dataclass(frozen=True)
class TensorUse:
    """One tensor an op touches: ``fresh`` if the op allocated its storage."""

    tensor: torch.Tensor
    key: int
    is_write: bool
    fresh: bool


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage (shared by its views), or ``None`` if it has none.

    Empty storages are left out: they all sit at address 0 and hold nothing to race on.
    """
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return int(storage.data_ptr())


def tensors_of(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op argument or result: a tensor, or a list or tuple of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                yield item


def tensor_uses(
    func: torch._ops.OpOverload,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    out: Any,
) -> list[TensorUse]:
    """The reads and writes of one op call, and the storages it allocated.

    A view op (``t``, ``slice``, ``detach``, ...) launches no kernel, so it touches
    nothing. Arguments the schema marks as written (in-place, ``out=``) are writes, other
    tensor arguments reads; results whose storage no argument shares are fresh
    allocations, written by the op.
    """
    if func.is_view:
        return []
    uses: list[TensorUse] = []
    seen: set[int] = set()
    schema_args = func._schema.arguments
    hidden = _hidden_writes(func, schema_args, args, kwargs)
    for index, argument in enumerate(schema_args):
        value = _argument(index, argument.name, args, kwargs)
        if value is None:
            continue
        alias = argument.alias_info
        is_write = (alias is not None and alias.is_write) or index in hidden
        for tensor in tensors_of(value):
            key = storage_key(tensor)
            if key is not None:
                seen.add(key)
                uses.append(TensorUse(tensor, key, is_write, fresh=False))
    for tensor in tensors_of(out):
        key = storage_key(tensor)
        if key is not None and key not in seen:
            seen.add(key)
            uses.append(TensorUse(tensor, key, is_write=True, fresh=True))
    return uses


def _argument(index: int, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(name)


def _hidden_writes(
    func: torch._ops.OpOverload,
    schema_args: Sequence[Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
) -> tuple[int, ...]:
    """The arguments ``func`` writes though its schema does not say so (see above)."""
    entry = _HIDDEN_WRITES.get(func._schema.name)
    if entry is None:
        return ()
    training, stats = entry
    if not _argument(training, schema_args[training].name, args, kwargs):
        return ()
    return stats
