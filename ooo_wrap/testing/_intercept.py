"""See every aten op with its arguments and results: the race detector's eyes.

This is the only file in ooo_wrap that imports ``TorchDispatchMode``. PyTorch has no public
API that shows each aten op with its schema and the tensors it touches (forward and,
inside the autograd engine, backward alike); ``torch.cuda._sanitizer`` uses the same
private class for the same reason. Nothing outside ``ooo_wrap.testing`` imports this file.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpHandler", "OpInterceptor"]

# (op, args, kwargs, result) -> None; called after the op ran.
OpHandler = Callable[[torch._ops.OpOverload, Sequence[Any], Mapping[str, Any], Any], None]


# The base class is untyped in torch: its constructor hooks are the untyped calls.
class OpInterceptor(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs every op unchanged, then reports it to ``handler``."""

    def __init__(self, handler: OpHandler) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._handler = handler

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._handler(func, args, kwargs, out)
        return out
