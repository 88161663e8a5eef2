"""The one place ooo_wrap relies on private PyTorch names or on APIs newer than torch 2.6.

Every torch API the library uses is in torch 2.6 (the declared minimum) except the ones
guarded here; docs/torch-versions.md lists each API with the version that added it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = [
    "forward_hook_dicts",
    "is_checkpoint_early_stop",
    "is_compiled_module",
    "stale_capture_streams_overridden",
    "storage_address",
    "storage_id",
    "storage_tensor",
    "stream_is_capturing",
    "wrap_checkpoint_unpacks",
]

UnpackHook = Callable[[Any], torch.Tensor]

# The private dicts ``register_forward_pre_hook`` / ``register_forward_hook`` fill, by name
# (each maps a handle id to a hook or to ``True``); present since torch 2.1.
_FORWARD_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


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


def wrap_checkpoint_unpacks(wrap: Callable[[UnpackHook], UnpackHook]) -> bool:
    """Make each non-reentrant checkpoint started from now on unpack its saved tensors
    through ``wrap(its unpack hook)``; returns whether this torch allows it.

    Non-reentrant ``torch.utils.checkpoint`` saves through the private
    ``saved_tensors_hooks`` subclass ``torch.utils.checkpoint._checkpoint_hook``,
    made once per checkpointed call and looked up by name as the call starts (as read in
    torch 2.13); its unpack hook recomputes on first use and returns a recomputed tensor.
    That name is bound, once per process, to a subclass whose unpack hook is wrapped (for
    every checkpoint in the process: ``wrap`` must change nothing where no stage runs).
    Without the name, nothing changes.
    """
    module: Any = torch.utils.checkpoint
    original = getattr(module, "_checkpoint_hook", None)
    if not isinstance(original, type):
        return False
    if getattr(original, "_ooo_wrap_unpacks", False):
        return True

    base: Any = original

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.unpack_hook = wrap(self.unpack_hook)

    namespace = {"__init__": __init__, "_ooo_wrap_unpacks": True}
    module._checkpoint_hook = type(original.__name__, (original,), namespace)
    return True


def stream_is_capturing(stream: Any) -> bool:
    """Whether ``stream``, the calling thread's current stream, is capturing a graph.

    ``torch.Stream.is_capturing`` is newer than torch 2.11. Without it, only CUDA can be
    asked, and only about its current stream (``torch.cuda.is_current_stream_capturing``),
    which is the one the scheduler asks about. ``torch.Stream.device_type`` is an int,
    not a string, so the stream's device is compared through ``stream.device``.
    """
    query = getattr(stream, "is_capturing", None)
    if query is not None:
        return bool(query())
    if torch.device(stream.device).type != "cuda":
        return False
    return bool(torch.cuda.is_current_stream_capturing())


def forward_hook_dicts(module: nn.Module) -> tuple[dict[int, Any], ...]:
    """The module's own forward hook dicts (private ``nn.Module`` attributes), in a fixed order.

    A removed hook can only be put back exactly (same handle id, same place in the call
    order) by writing these dicts: registering it again appends it under a new id.
    """
    return tuple(getattr(module, name) for name in _FORWARD_HOOK_DICTS)


@contextlib.contextmanager
def stale_capture_streams_overridden() -> Iterator[bool]:
    """Let autograd, during a CUDA graph capture, run a node that still names a stream from
    before the capture (a gradient accumulator kept alive since an eager warm-up) on the
    producer's capturing stream instead; yields whether this torch can.

    ``torch.autograd.graph.set_override_stale_capture_stream`` is newer than torch 2.11 and
    process-wide, so it is set only where present and only for the block, then put back
    as it was, read through the private getter ``torch._C._override_stale_capture_stream``
    (added with it). Without both, nothing changes.
    """
    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    getter = getattr(torch._C, "_override_stale_capture_stream", None)
    if setter is None or getter is None:
        yield False
        return
    before = bool(getter())
    setter(True)
    try:
        yield True
    finally:
        setter(before)


# Two identities of a tensor's storage, for two questions. Views share both.
#
# ``storage_id`` asks *which StorageImpl* (the planner's dataflow, the deferred joins: is
# this input a view of that output?). It holds on the ``meta`` device and for empty
# tensors, where every address is 0, and it survives ``resize_``.
#
# ``storage_address`` asks *which memory* (the race checker's model of the caching
# allocator): ``resize_`` or an ``out=`` argument resized by an op moves the same
# StorageImpl to a new block, which the checker must see as a fresh allocation.


def storage_id(tensor: torch.Tensor) -> int:
    """The identity of the StorageImpl holding ``tensor``'s elements.

    PyTorch has no public storage identity; ``UntypedStorage._cdata`` is the address of the
    C++ StorageImpl. Like an address it may be reused once the storage is freed.

    Raises:
        RuntimeError, NotImplementedError: ``tensor`` has no storage of its own (a sparse
            tensor, a ``vmap`` wrapper), as ``untyped_storage()`` raises.
    """
    return int(tensor.untyped_storage()._cdata)


def storage_address(tensor: torch.Tensor) -> int:
    """The device address of the memory block of ``tensor``'s storage (0 on ``meta`` and
    for an empty storage); raises as :func:`storage_id` does."""
    return int(tensor.untyped_storage().data_ptr())


def storage_tensor(tensor: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor under ``tensor``'s functorch wrappers (``vmap``, ``torch.func.grad``,
    functionalization), or ``None`` if it is not wrapped.

    Wrappers have no storage of their own: the wrapped tensor holds the memory (and the
    allocator's ``record_stream`` mark, which has no batching rule). torch has no public
    unwrap; these private ``torch._C._functorch`` calls are the ones torch._functorch uses.
    """
    functorch = torch._C._functorch
    inner = tensor
    while functorch.is_functorch_wrapped_tensor(inner) or functorch.is_functionaltensor(inner):
        unwrapped: torch.Tensor = functorch.get_unwrapped(inner)
        if unwrapped is inner:
            break
        inner = unwrapped
    return None if inner is tensor else inner
