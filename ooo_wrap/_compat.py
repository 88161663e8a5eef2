"""The one place ooo_wrap relies on private PyTorch names or on APIs newer than torch 2.6.

Every torch API the library uses is in torch 2.6 (the declared minimum) except the ones
guarded here; docs/torch-versions.md lists each API with the version that added it. Two
exceptions, each confined to one file of its own and listed there too: ``torch.utils._pytree``
(``_tensors.py``) and ``TorchDispatchMode`` (``_planner/intercept.py``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.utils.checkpoint
from torch import nn
from torch._C import (
    _get_function_stack_at,
    _len_torch_function_stack,
    _pop_torch_function_stack,
    _push_on_torch_function_stack,
)
from torch.autograd.graph import Node
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

__all__ = [
    "MODULE_CHILDREN_KEY",
    "ModeArgs",
    "ModeFunc",
    "ModeKwargs",
    "ModeTypes",
    "autograd_sequence_nr",
    "current_autograd_node",
    "first_input_shape",
    "forward_hook_dicts",
    "function_mode_position",
    "functorch_transforms_active",
    "is_checkpoint_early_stop",
    "is_compiled_module",
    "leave_dispatch_mode",
    "modes_set_aside",
    "node_metadata",
    "node_sequence_nr",
    "put_function_mode_under",
    "queue_engine_callback",
    "stale_capture_streams_overridden",
    "storage_address",
    "storage_id",
    "storage_tensor",
    "stream_is_capturing",
    "take_function_mode_off",
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

# ``nn.Module`` keeps its child modules in the private dict attribute ``_modules``, so a
# module's state (``__getstate__``, ``vars()``) holds them under that key (since torch 1.0).
# The wrapper's pickling rewrites that dict (``_wrapper/serialize.py``): no public API
# builds a module's state with other children.
MODULE_CHILDREN_KEY = "_modules"


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


# --- the autograd engine: its running node, its callbacks, its node numbers ------------
#
# The race checker models the engine's stream semantics from node hooks
# (``testing/_engine.py``, ``testing/_node_tags.py``); the wrapper reads and releases
# gradient accumulators (``_runtime/accumulators.py``). PyTorch has no public API for any
# of what follows; each is in torch 2.6.


def current_autograd_node() -> Node | None:
    """The node the autograd engine is running on this thread, or ``None`` outside one.

    ``torch._C._current_autograd_node`` (private; the profiler and ``torch.utils.checkpoint``
    use it for the same question).
    """
    node: Node | None = torch._C._current_autograd_node()
    return node


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the graph task now running ends (where the engine syncs the
    caller's stream with the leaf streams).

    The engine's own end-of-backward hook, ``Variable._execution_engine.queue_callback``
    (private; what DDP and FSDP use).
    """
    engine: Any = torch.autograd.Variable._execution_engine
    engine.queue_callback(callback)


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread will get.

    ``torch._C._autograd._get_sequence_nr`` (private; the profiler's, which matches ops to
    nodes the same way).
    """
    return int(torch._C._autograd._get_sequence_nr())


def node_sequence_nr(node: Node) -> int:
    """The sequence number ``node`` was made with (``AccumulateGrad``: the largest int).

    ``Node._sequence_nr()`` (private).
    """
    return int(cast(Any, node)._sequence_nr())


def node_metadata(node: Node) -> dict[str, Any]:
    """``node.metadata``: the node's dict for whoever holds it (public, but a property at
    run time where torch's stubs declare a method)."""
    metadata: dict[str, Any] = cast(Any, node).metadata
    return metadata


def first_input_shape(node: Node) -> tuple[int, ...] | None:
    """The shape of ``node``'s first input as the node recorded it when it was made, or
    ``None`` if it recorded none.

    ``Node._input_metadata`` (private): tells a leaf's cached ``AccumulateGrad`` (which
    recorded the leaf's shape) from one just made while the leaf had another.
    """
    metadata = cast(Any, node)._input_metadata
    return tuple(metadata[0].shape) if metadata else None


@contextlib.contextmanager
def modes_set_aside() -> Iterator[None]:
    """No dispatch or function mode of this thread sees the ops run inside the block.

    ``torch.utils._python_dispatch._disable_current_modes`` (private) pops the dispatch
    modes for the block and puts them back; the function modes are turned off by
    ``torch._C.DisableTorchFunction`` (in the private ``torch._C``; it turns off every
    function mode and subclass, where the public ``DisableTorchFunctionSubclass`` leaves
    the modes on).
    """
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (``vmap``, ``torch.func.grad``) is running on this
    thread: ``torch._C._are_functorch_transforms_active`` (private; no public query)."""
    return bool(torch._C._are_functorch_transforms_active())


# --- the thread's function mode stack, below its top -----------------------------------
#
# ``TorchFunctionMode`` is public (``torch.overrides``), but a mode entered with ``with``
# leaves by popping the top of the thread's mode stack, whichever mode that is. The
# deferred joins' mode (``_runtime/deferred.py``) is put on and taken off outside any
# ``with``, so it must never be on top of a user's mode, and the stack has no public API
# to insert or remove below the top. The private ``torch._C`` stack functions imported
# above are the ones ``torch.overrides`` and ``torch.utils._device`` use to the same end.


# The parameters of ``TorchFunctionMode.__torch_function__``, which every mode declares.
ModeFunc = Callable[..., Any]
ModeTypes = Sequence[type]
ModeArgs = Sequence[Any]
ModeKwargs = Mapping[str, Any] | None


def function_mode_position(mode: object) -> int | None:
    """Where ``mode`` is on this thread's function mode stack (0: the bottom), if it is."""
    for index in range(_len_torch_function_stack()):
        if _get_function_stack_at(index) is mode:
            return index
    return None


def take_function_mode_off(mode: object) -> None:
    """Remove ``mode`` from the stack, leaving every other mode where it was."""
    index = function_mode_position(mode)
    if index is None:
        return  # someone else took it off already
    above = [_pop_torch_function_stack() for _ in range(_len_torch_function_stack() - index)]
    for other in reversed(above):
        if other is not mode:
            _push_on_torch_function_stack(other)


def put_function_mode_under(mode: TorchFunctionMode) -> None:
    """Push ``mode`` below every mode on the stack (but the default device's): a user's
    ``with`` block then pops its own mode when it ends, and its ops reach ours after
    its mode ran."""
    depth = _len_torch_function_stack()
    # ``torch.set_default_device`` keeps its mode at the very bottom (kept on the private
    # ``torch._GLOBAL_DEVICE_CONTEXT``) and asserts it is there when the default changes:
    # ours goes just above that one. A ``with torch.device(...)`` block's mode is pushed on
    # top and popped from the top like a user's, so ours goes under it.
    default = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    bottom = 1 if depth and default is not None and _get_function_stack_at(0) is default else 0
    above = [_pop_torch_function_stack() for _ in range(depth - bottom)]
    _push_on_torch_function_stack(mode)
    for other in reversed(above):
        _push_on_torch_function_stack(other)


# --- the thread's dispatch mode stack, below its top -----------------------------------


def leave_dispatch_mode(mode: Any) -> bool:
    """Leave ``mode``, a dispatch mode this thread entered with ``__enter__`` and never left,
    wherever it is on this thread's stack: modes pushed after it stay where they are.
    Returns whether it was on this thread's stack (and is now left).

    The dispatch mode of the dataflow planner's observation is entered in a root
    pre-hook and left in the post-hook; a forward that a ``BaseException`` ended skips the
    post-hook, and a mode entered since (a user's ``with``) may be above it by the time it
    is left. ``__exit__`` pops the top of the stack (and restores the flags ``__enter__``
    saved), so the modes above are set aside with the private ``torch._C`` stack functions
    ``torch.utils._python_dispatch`` uses (in torch 2.6). Without them, ``__exit__`` pops
    the top, as the end of a ``with`` block would.
    """
    length = getattr(torch._C, "_len_torch_dispatch_stack", None)
    at = getattr(torch._C, "_get_dispatch_stack_at", None)
    pop = getattr(torch._C, "_pop_torch_dispatch_stack", None)
    push = getattr(torch._C, "_push_on_torch_dispatch_stack", None)
    if length is None or at is None or pop is None or push is None:
        mode.__exit__(None, None, None)
        return True
    depth = int(length())
    if not any(at(index) is mode for index in range(depth)):
        return False
    above = []  # popped from the top down; ``mode`` is a user mode, below no infra mode
    while (top := pop(None)) is not mode:
        above.append(top)
    push(mode)
    try:
        mode.__exit__(None, None, None)
    finally:
        for other in reversed(above):
            push(other)
    return True
