"""Which arguments an aten op writes: its schema, and the writes its schema leaves out.

One reader for the dataflow planner's observer (``observe.py``) and the race checker
(``testing/_ops.py``): an op both must see as a write, such as batch norm updating its
running statistics, is then known to both or to neither.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from .._compat import op_schema
from .._tensors import tensors_in
from .intercept import OpArgs, OpKwargs, OpOverload

__all__ = ["HIDDEN_WRITES", "arguments", "declared_writes"]

# Ops that update arguments in place although their schema does not mark them as written:
# schema name -> (the flag argument the update happens under, or None if always; the
# arguments updated). Every overload of a name (``.out`` too) shares its arguments' order.
HIDDEN_WRITES: Mapping[str, tuple[int | None, tuple[int, ...]]] = {
    # running_mean and running_var, in training (``_native_batch_norm_legit``, which
    # torch.compile and export use, marks them in its schema)
    "aten::native_batch_norm": (5, (3, 4)),
    "aten::cudnn_batch_norm": (5, (3, 4)),
    "aten::miopen_batch_norm": (5, (3, 4)),
    # the running statistics, whenever given (SyncBatchNorm's kernels)
    "aten::batch_norm_update_stats": (None, (1, 2)),
    "aten::batch_norm_gather_stats_with_counts": (None, (3, 4)),
}


def _argument(index: int, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    if index < len(args):
        return args[index]
    return kwargs.get(name)


def arguments(func: OpOverload, args: OpArgs, kwargs: OpKwargs) -> Iterator[tuple[Any, bool]]:
    """``(value, written)`` for each argument of the call that is not ``None``, in schema
    order: ``written`` if the schema marks it as written (in-place, ``out=``) or the op
    updates it anyway (``HIDDEN_WRITES``)."""
    schema = op_schema(func)
    schema_args = schema.arguments
    hidden: tuple[int, ...] = ()
    entry = HIDDEN_WRITES.get(schema.name)
    if entry is not None:
        flag, updated = entry
        if flag is None or _argument(flag, schema_args[flag].name, args, kwargs):
            hidden = updated
    for index, argument in enumerate(schema_args):
        value = _argument(index, argument.name, args, kwargs)
        if value is None:
            continue
        alias = argument.alias_info
        yield value, (alias is not None and alias.is_write) or index in hidden


def declared_writes(func: OpOverload, args: OpArgs, kwargs: OpKwargs) -> list[torch.Tensor]:
    """The tensors the schema marks as written: the only ones an op may give new memory
    (``out=`` resizing, ``resize_``)."""
    written: list[torch.Tensor] = []
    for index, argument in enumerate(op_schema(func).arguments):
        alias = argument.alias_info
        if alias is not None and alias.is_write:
            written += tensors_in(_argument(index, argument.name, args, kwargs))
    return written
