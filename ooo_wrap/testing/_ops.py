"""Which storages an aten op reads, writes and allocates, from its schema."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._schema import arguments, declared_writes
from .._tensors import tensors_in

__all__ = [
    "DATA_DEPENDENT_OPS",
    "HOST_SYNC_OPS",
    "TensorUse",
    "byte_span",
    "is_view_only",
    "storage_key",
    "syncs_host",
    "tensor_uses",
    "unwrap",
    "written_keys",
]

# Ops after which the host holds until the device is done: ``.item()`` (and what calls
# it), and the detector's host_read().
HOST_SYNC_OPS = frozenset({"aten._local_scalar_dense.default", "host_read"})

# Ops whose result the host must read before it can go on: the output's size depends on
# the data (``nonzero`` and what is built on it), or the result is a Python value
# (``equal``). On a GPU each is a host sync, which a graph capture refuses; on the CPU
# nothing waits, so only the op's name tells.
DATA_DEPENDENT_OPS = frozenset(
    {
        "aten.nonzero.default",
        "aten.masked_select.default",
        "aten._unique.default",
        "aten._unique2.default",
        "aten.unique_dim.default",
        "aten.unique_consecutive.default",
        "aten.bincount.default",
        "aten.equal.default",
        "aten.is_nonzero.default",
    }
)

# Indexing with a boolean mask finds the mask's true elements (a nonzero inside the
# kernel, below what the dispatcher shows).
_INDEX_OPS = frozenset(
    {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
)
_MASK_DTYPES = (torch.bool, torch.uint8)


def syncs_host(func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether the op makes the host wait for the device on a GPU (see above)."""
    name = str(func)
    if name in HOST_SYNC_OPS or name in DATA_DEPENDENT_OPS:
        return True
    if name == "aten.repeat_interleave.Tensor":  # its output size, unless given
        return kwargs.get("output_size") is None
    if func._schema.name in _INDEX_OPS and len(args) > 1:
        return any(
            isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES
            for index in args[1]
            if index is not None
        )
    return False


# Tensors made from host data (torch.tensor, as_tensor, from_numpy, the scalar of
# ``t[i] = 3``) are allocated outside the dispatcher, which shows them only as this
# aliasing op: it is where their memory comes into use, on the current stream.
_LIFT = "aten::lift_fresh"


@dataclass(frozen=True)
class TensorUse:
    """One tensor an op touches: ``fresh`` if the op allocated its storage."""

    tensor: torch.Tensor
    key: int
    is_write: bool
    fresh: bool

    @property
    def span(self) -> tuple[int, int]:
        """The bytes of the storage from the tensor's first element to its last."""
        return byte_span(self.tensor)


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[start, end)`` of ``tensor``'s storage its elements lie in (empty if none)."""
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    if tensor.numel() == 0:
        return (start, start)
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return (start, start + (int(last) + 1) * size)


def unwrap(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor holding the memory of a functorch wrapper (``vmap``, ``torch.func.grad``,
    functionalization), or ``tensor`` itself.

    Wrappers have no storage of their own. torch has no public call that unwraps them;
    this is the one ``torch._functorch`` uses itself.
    """
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(tensor) or functorch.is_functionaltensor(tensor):
        inner: torch.Tensor = functorch.get_unwrapped(tensor)
        if inner is tensor:
            break
        tensor = inner
    return tensor


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage (shared by its views), or ``None`` if it has none.

    Empty storages are left out: they all sit at address 0 and hold nothing to race on.
    A functorch wrapper counts as the tensor it wraps.
    """
    tensor = unwrap(tensor)
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return int(storage.data_ptr())


def is_view_only(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` only makes a view: no kernel, no allocation."""
    return func.is_view and func._schema.name != _LIFT


def written_keys(
    func: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[int | None] | None:
    """Storages of the arguments ``func`` writes, before it runs (``None``: it writes none).

    An op may give a written argument new memory (``out=`` resizing, ``resize_``): the
    storage then differs after the op, and that memory was allocated by it.
    """
    if not func._schema.is_mutable:
        return None
    return [storage_key(t) for t in declared_writes(func, args, kwargs)]


def tensor_uses(
    func: torch._ops.OpOverload,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    out: Any,
    before: Sequence[int | None] | None = None,
) -> list[TensorUse]:
    """The reads and writes of one op call, and the storages it allocated.

    A view op (``t``, ``slice``, ``detach``, ...) launches no kernel, so it touches
    nothing. Arguments the op writes (``ooo_wrap._schema.arguments``: in-place, ``out=``,
    and the writes schemas leave out) are writes, other tensor arguments reads; results
    whose storage no argument shares are fresh allocations, written by the op. ``before``
    (from :func:`written_keys`) tells which written arguments got new memory from the op:
    those are fresh too.
    """
    if func._schema.name == _LIFT:
        return [TensorUse(t, k, True, True) for t in tensors_in(out) if (k := storage_key(t))]
    if func.is_view:
        return []
    uses: list[TensorUse] = []
    seen: set[int] = set()
    if before is not None:
        for tensor, old in zip(declared_writes(func, args, kwargs), before, strict=False):
            key = storage_key(tensor)
            if key is not None and key != old and key not in seen:
                seen.add(key)
                uses.append(TensorUse(tensor, key, is_write=True, fresh=True))
    for value, is_write in arguments(func, args, kwargs):
        for tensor in tensors_in(value):
            key = storage_key(tensor)
            if key is not None:
                seen.add(key)
                uses.append(TensorUse(tensor, key, is_write, fresh=False))
    for tensor in tensors_in(out):
        key = storage_key(tensor)
        if key is not None and key not in seen:
            seen.add(key)
            uses.append(TensorUse(tensor, key, is_write=True, fresh=True))
    return uses
