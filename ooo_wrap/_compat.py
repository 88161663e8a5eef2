"""The one place ooo_wrap relies on private PyTorch names."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["is_checkpoint_early_stop", "is_compiled_module"]


def is_compiled_module(model: nn.Module) -> bool:
    """Whether ``model`` is what ``torch.compile(module)`` returned.

    PyTorch has no public type or predicate for it: ``torch.compile`` wraps modules in
    the private ``torch._dynamo.eval_frame.OptimizedModule``. If that module was never
    imported, nothing in this process has been compiled, so the import is not forced.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return optimized is not None and isinstance(model, optimized)


def is_checkpoint_early_stop(error: BaseException) -> bool:
    """Whether ``error`` is how non-reentrant ``torch.utils.checkpoint`` ends a recomputation.

    Once backward has every tensor it needs, checkpoint stops recomputing by raising the
    private ``torch.utils.checkpoint._StopRecomputationError`` through the module being
    recomputed (a stage, when checkpoint wraps one) and catching it itself: control flow,
    not a stage failure. If the module was never imported, no checkpoint is running.
    """
    checkpoint = sys.modules.get("torch.utils.checkpoint")
    stop = getattr(checkpoint, "_StopRecomputationError", None)
    return stop is not None and isinstance(error, stop)
