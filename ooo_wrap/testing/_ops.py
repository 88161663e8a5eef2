"""Which storages an aten op reads, writes and allocates, from its schema."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._compat import op_schema, storage_address, storage_tensor
from .._planner.intercept import OpArgs, OpKwargs, OpOverload
from .._planner.schema import arguments, declared_writes
from .._tensors import tensors_in

__all__ = [
    "HOST_SYNCS",
    "TensorUse",
    "always_syncs",
    "byte_span",
    "host_sync",
    "is_view_only",
    "storage_key",
    "tensor_uses",
    "written_keys",
]

_SIZE = "its output's size depends on the data"
_MASKED = "a boolean mask: the count of its true elements depends on the data"
_BOOL = "its result, a Python bool, depends on the data"
_INFO = "with check_errors=True it reads the factorization's info on the host"

# What makes the host wait for the device on CUDA, which a graph capture refuses (nothing
# has run yet): recorded op name (an aten overload, or what the detector records a host
# read as) -> why, as the capture error says it. On the CPU nothing waits, and most of
# these show no op of their own: only the name tells.
HOST_SYNCS: Mapping[str, str] = {
    # The host reads values (``_host.py`` sees the Tensor methods).
    "host_read": "a host read (host_read())",
    "aten._local_scalar_dense.default": "a host read (.item(), float(), int(), bool())",
    "Tensor.tolist": "a host read (.tolist())",
    "Tensor.numpy": "a host read (.numpy())",
    "Tensor.__array__": "a host read (numpy.asarray(), numpy.array())",
    "Tensor.cpu": "a host read (.cpu(): a copy to the host)",
    "Tensor.to": "a host read (.to('cpu'): a copy to the host)",
    "Tensor.__repr__": "a host read (print(), str() or repr() of a tensor)",
    "Tensor.__format__": "a host read (a tensor in an f-string or format())",
    # The result is a Python value computed on the device.
    "aten.equal.default": _BOOL,
    "aten.allclose.default": _BOOL,
    "aten.is_nonzero.default": _BOOL,
    # The output's size depends on the data (``nonzero`` and what is built on it).
    "aten.nonzero.default": _SIZE,
    "aten.masked_select.default": _SIZE,
    "aten._unique.default": _SIZE,
    "aten._unique2.default": _SIZE,
    "aten.unique_dim.default": _SIZE,
    "aten.unique_consecutive.default": _SIZE,
    "aten.bincount.default": _SIZE,
    # ... unless ``output_size`` is given.
    "aten.repeat_interleave.Tensor": _SIZE,
    # ... with a boolean mask, whose true elements the kernel finds (a nonzero inside it).
    "aten.index.Tensor": _MASKED,
    "aten.index_put.default": _MASKED,
    "aten.index_put_.default": _MASKED,
    "aten._index_put_impl_.default": _MASKED,
    # The CUDA kernel reads a result on the host: the info of a factorization, to raise on
    # a singular input (linalg.cholesky, inv, solve; the _ex forms unless check_errors=True).
    "aten._linalg_check_errors.default": "it reads the factorization's info on the host",
    "aten.linalg_cholesky_ex.default": _INFO,
    "aten.linalg_inv_ex.default": _INFO,
    "aten._linalg_solve_ex.default": _INFO,
    "aten.linalg_lu_factor_ex.default": _INFO,
    "aten.linalg_ldl_factor_ex.default": _INFO,
    # ... the input's min and max, when no range is given (min == max, the default).
    "aten.histc.default": "with no range given, the kernel reads the input's min and max",
}

_MASK_DTYPES = (torch.bool, torch.uint8)


def _mask(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    return len(args) > 1 and any(
        isinstance(index, torch.Tensor) and index.dtype in _MASK_DTYPES
        for index in args[1]
        if index is not None
    )


def _no_range(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    low = args[2] if len(args) > 2 else kwargs.get("min", 0)
    high = args[3] if len(args) > 3 else kwargs.get("max", 0)
    return bool(low == high)


def _checks_errors(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    return bool(kwargs.get("check_errors", False))


# The entries above that sync only for some arguments: whether this call does.
_SYNCS_IF: Mapping[str, Callable[[Sequence[Any], Mapping[str, Any]], bool]] = {
    "aten.repeat_interleave.Tensor": lambda args, kwargs: kwargs.get("output_size") is None,
    "aten.index.Tensor": _mask,
    "aten.index_put.default": _mask,
    "aten.index_put_.default": _mask,
    "aten._index_put_impl_.default": _mask,
    "aten.linalg_cholesky_ex.default": _checks_errors,
    "aten.linalg_inv_ex.default": _checks_errors,
    "aten._linalg_solve_ex.default": _checks_errors,
    "aten.linalg_lu_factor_ex.default": _checks_errors,
    "aten.linalg_ldl_factor_ex.default": _checks_errors,
    "aten.histc.default": _no_range,
}


def host_sync(func: OpOverload, args: OpArgs, kwargs: OpKwargs) -> str | None:
    """Why the op makes the host wait for the device on a GPU, or ``None`` (see above)."""
    name = str(func)
    why = HOST_SYNCS.get(name)
    if why is None:
        return None
    only_if = _SYNCS_IF.get(name)
    return why if only_if is None or only_if(args, kwargs) else None


def always_syncs(op: str) -> bool:
    """Whether every call of the recorded op ``op`` makes the host wait (see above)."""
    return op in HOST_SYNCS and op not in _SYNCS_IF


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


def storage_key(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage (shared by its views), or ``None`` if it has none.

    The memory (:func:`~ooo_wrap._compat.storage_address`), not the StorageImpl: the
    allocator model follows blocks, and an op that gives a written argument new memory
    (``resize_``, ``out=``) keeps its StorageImpl. Empty storages are left out: they all
    sit at address 0 and hold nothing to race on. A functorch wrapper counts as the
    tensor it wraps.
    """
    inner = storage_tensor(tensor)
    if inner is not None:
        tensor = inner
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        return None
    if tensor.untyped_storage().nbytes() == 0:
        return None
    return storage_address(tensor)


def is_view_only(func: OpOverload) -> bool:
    """Whether ``func`` only makes a view: no kernel, no allocation."""
    return func.is_view and op_schema(func).name != _LIFT


def written_keys(func: OpOverload, args: OpArgs, kwargs: OpKwargs) -> list[int | None] | None:
    """Storages of the arguments ``func`` writes, before it runs (``None``: it writes none).

    An op may give a written argument new memory (``out=`` resizing, ``resize_``): the
    storage then differs after the op, and that memory was allocated by it.
    """
    if not op_schema(func).is_mutable:
        return None
    return [storage_key(t) for t in declared_writes(func, args, kwargs)]


def tensor_uses(
    func: OpOverload,
    args: OpArgs,
    kwargs: OpKwargs,
    out: Any,
    before: Sequence[int | None] | None = None,
) -> list[TensorUse]:
    """The reads and writes of one op call, and the storages it allocated.

    A view op (``t``, ``slice``, ``detach``, ...) launches no kernel, so it touches
    nothing. Arguments the op writes (``ooo_wrap._planner.schema.arguments``: in-place, ``out=``,
    and the writes schemas leave out) are writes, other tensor arguments reads; results
    whose storage no argument shares are fresh allocations, written by the op. ``before``
    (from :func:`written_keys`) tells which written arguments got new memory from the op:
    those are fresh too.
    """
    if op_schema(func).name == _LIFT:
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
