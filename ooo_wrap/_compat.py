"""The one place ooo_wrap relies on a private PyTorch name."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["is_compiled_module"]


def is_compiled_module(model: nn.Module) -> bool:
    """Whether ``model`` is what ``torch.compile(module)`` returned.

    PyTorch has no public type or predicate for it: ``torch.compile`` wraps modules in
    the private ``torch._dynamo.eval_frame.OptimizedModule``. If that module was never
    imported, nothing in this process has been compiled, so the import is not forced.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(model, optimized)
