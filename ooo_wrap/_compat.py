"""The one place ooo_wrap reads private PyTorch names, and APIs newer than torch 2.6.

The rule: every private PyTorch name ooo_wrap relies on is read here, on first use (never
as ``import ooo_wrap`` runs), through :func:`private`, and is listed in
:data:`PRIVATE_NAMES` with what ooo_wrap does without it. On a torch that lacks one (renamed
or removed), ``import ooo_wrap`` and wrapping still work: the feature that needs the name is
off, and one warning per process names it. Where the scheduler's correctness depends on a
name, off means the model runs plain (a ``DISABLED`` event says why), never that it streams
unguarded. ``tests/project/test_compat_names.py`` checks that the installed torch has every
name, and, hiding each in a fresh process, that wrapping and training still work with
exactly that one warning. docs/torch-versions.md lists each API with the release that
added it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import operator
import sys
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from torch._ops import OpOverload as OpOverload  # for the type checker only
else:
    OpOverload = Any  # an aten op as a dispatch mode sees it; never looked up at run time

__all__ = [
    "MODULE_CHILDREN_KEY",
    "PRIVATE_NAMES",
    "DispatchModeBase",
    "ModeArgs",
    "ModeFunc",
    "ModeKwargs",
    "ModeTypes",
    "OpOverload",
    "PrivateName",
    "accumulator_lookups_work",
    "autograd_sequence_nr",
    "checker_names_found",
    "current_autograd_node",
    "dataflow_names_found",
    "deferred_joins_work",
    "device_live_bytes",
    "first_input_shape",
    "flop_formulas",
    "forward_hook_dicts",
    "function_mode_position",
    "functorch_transforms_active",
    "handle_dicts",
    "hook_dicts",
    "is_checkpoint_early_stop",
    "is_compiled_module",
    "is_fsdp_managed",
    "leave_dispatch_mode",
    "modes_set_aside",
    "module_call_frame",
    "module_calls_on_stack",
    "module_calls_visible",
    "next_hook_id",
    "node_metadata",
    "node_sequence_nr",
    "op_schema",
    "private",
    "put_function_mode_under",
    "pytree_nodes",
    "queue_engine_callback",
    "replace_thread_target",
    "stale_capture_streams_overridden",
    "storage_address",
    "storage_id",
    "storage_tensor",
    "stream_is_capturing",
    "streaming_names_found",
    "take_function_mode_off",
    "tensor_version",
    "thread_target",
    "wrap_checkpoint_unpacks",
]


# --- the guard ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PrivateName:
    """A private PyTorch name ooo_wrap reads, and what ooo_wrap does on a torch without it."""

    path: str  # dotted, from ``torch``: where it is read
    without: str  # what turns off, as the warning says it


_PLAIN = "wrapped models run plain (standard backward, a DISABLED event says why)"
_NO_OVERLAP = "overlap_forward=True joins every stage call at once (no forward overlap)"
_NO_LEARNING = "plans are not learned from the dataflow: the static plan is used"
_NO_RELEASE = (
    "gradient accumulators stay on the stream that first made them (correct; the "
    "caller's stream may wait on each stage's gradients)"
)
_NO_UNWRAP = (
    "a stage called under torch.func.vmap or torch.func.grad raises where record_stream "
    "has no batching rule"
)
_NO_CHECKER = "the race checker (ooo_wrap.testing.check, detect) raises OOOError"
_NO_FLOPS = "estimated op costs count no FLOPs (bytes moved only)"
_NO_LEAVE = (
    "the observation of a learning forward that an interrupt ended is left as a with block "
    "ends: a dispatch mode entered since is popped in its place"
)

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    # Non-reentrant checkpoint's saved-tensor hooks: a recomputation in backward is ordered
    # for the streams that read it by wrapping their unpack hook (``_runtime/recompute.py``).
    PrivateName("torch.utils.checkpoint._checkpoint_hook", _PLAIN),
    PrivateName(
        "torch.utils.checkpoint._StopRecomputationError",
        "each early stop of a checkpoint's recomputation is recorded as a STAGE_FAILED event",
    ),
    PrivateName(
        "torch._dynamo.eval_frame.OptimizedModule",
        "a torch.compile'd model is not recognised as one: wrap the model, then compile it",
    ),
    # The thread's function mode stack and the default device's mode (the deferred joins'
    # mode goes below the user's modes), storage identity and version counters.
    PrivateName("torch._C._len_torch_function_stack", _NO_OVERLAP),
    PrivateName("torch._C._get_function_stack_at", _NO_OVERLAP),
    PrivateName("torch._C._pop_torch_function_stack", _NO_OVERLAP),
    PrivateName("torch._C._push_on_torch_function_stack", _NO_OVERLAP),
    PrivateName("torch._GLOBAL_DEVICE_CONTEXT", _NO_OVERLAP),
    PrivateName("torch._C.TensorBase._version", _NO_OVERLAP),
    PrivateName("torch._C.StorageBase._cdata", f"{_NO_OVERLAP}; {_NO_LEARNING}"),
    PrivateName("torch.utils._python_dispatch.TorchDispatchMode", f"{_NO_LEARNING}; {_NO_CHECKER}"),
    # The thread's dispatch mode stack: the planner's observation is left wherever it is on
    # it (``_planner/observe.py``), below a mode a user entered after an interrupt.
    PrivateName("torch._C._len_torch_dispatch_stack", _NO_LEAVE),
    PrivateName("torch._C._get_dispatch_stack_at", _NO_LEAVE),
    PrivateName("torch._C._pop_torch_dispatch_stack", _NO_LEAVE),
    PrivateName("torch._C._push_on_torch_dispatch_stack", _NO_LEAVE),
    # Gradient accumulator look-ups (``_runtime/accumulators.py``).
    PrivateName("torch.utils._python_dispatch._disable_current_modes", _NO_RELEASE),
    PrivateName("torch._C.DisableTorchFunction", _NO_RELEASE),
    PrivateName(
        "torch._C._are_functorch_transforms_active",
        f"{_NO_RELEASE}; the weight-gradient split steps aside at every layer call",
    ),
    PrivateName("torch._C._functions.AccumulateGrad._input_metadata", _NO_RELEASE),
    # The tensor under a functorch wrapper.
    PrivateName("torch._C._functorch.is_functorch_wrapped_tensor", _NO_UNWRAP),
    PrivateName("torch._C._functorch.is_functionaltensor", _NO_UNWRAP),
    PrivateName("torch._C._functorch.get_unwrapped", _NO_UNWRAP),
    # Containers registered with torch's pytree (``_tensors.py``): a tensor in one that the
    # stage hooks cannot see gets no record_stream.
    PrivateName("torch.utils._pytree.SUPPORTED_NODES", _PLAIN),
    # FLOP formulas (``_planner/cost.py``).
    PrivateName("torch.utils.flop_counter.flop_registry", _NO_FLOPS),
    PrivateName("torch.utils.flop_counter.shape_wrapper", _NO_FLOPS),
    # The autograd engine, as the race checker models it.
    PrivateName("torch._C._current_autograd_node", _NO_CHECKER),
    PrivateName("torch.autograd.Variable._execution_engine", _NO_CHECKER),
    PrivateName("torch._C._autograd._get_sequence_nr", _NO_CHECKER),
    PrivateName("torch._C._functions.AccumulateGrad._sequence_nr", _NO_CHECKER),
    # The getter of torch.autograd.graph.set_override_stale_capture_stream (newer than
    # 2.11): missed only where the setter is there.
    PrivateName(
        "torch._C._override_stale_capture_stream",
        "graphed_step captures without the stale capture stream override",
    ),
)
_WITHOUT = {name.path: name.without for name in PRIVATE_NAMES}
_warned: set[str] = set()


def private(path: str, *, if_imported: str | None = None) -> Any:
    """The object at ``path`` (one of :data:`PRIVATE_NAMES`), or ``None`` where this torch
    has none: then warn, once per process, naming it and what is off.

    Read when called, never cached here (callers on a hot path keep what they got). With
    ``if_imported``, a module no one has imported yet (so nothing in it can be in use) is
    not imported: ``None`` then, without a warning.
    """
    if if_imported is not None and if_imported not in sys.modules:
        return None
    parts = path.split(".")
    value: Any = torch
    for depth in range(1, len(parts)):
        try:
            value = getattr(value, parts[depth])
            continue
        except AttributeError:
            pass
        try:  # a submodule not imported yet
            if not isinstance(value, types.ModuleType):
                raise ImportError(path)
            value = importlib.import_module(".".join(parts[: depth + 1]))
        except ImportError:
            value = None
            break
    if value is None:
        _missing(path)
    return value


_hot: dict[str, Any] = {}


def _once(path: str) -> Any:
    """:func:`private`, looked up on the first call only: for what runs per op or per tensor
    (after a check such as :func:`checker_names_found` made sure it is there)."""
    try:
        return _hot[path]
    except KeyError:
        found = _hot[path] = private(path)
        return found


def _missing(path: str, problem: str = "has no") -> None:
    """Warn, once per process, that this torch has no ``path`` (or, with ``problem``, that
    its ``path`` is not what ooo_wrap reads)."""
    if path in _warned:
        return
    _warned.add(path)
    warnings.warn(
        f"ooo_wrap: this torch ({torch.__version__}) {problem} {path}, a private PyTorch name "
        f"ooo_wrap relies on; {_WITHOUT[path]}. Please report it with your torch version",
        stacklevel=3,
    )


def _found(*paths: str) -> bool:
    """Whether this torch has every one of ``paths`` (each missing one warned about)."""
    return all([private(path) is not None for path in paths])  # a list: warn for each


def deferred_joins_work() -> bool:
    """Whether ``overlap_forward=True`` can defer joins on this torch."""
    return _found(
        *_STACK_CALLS,
        "torch._GLOBAL_DEVICE_CONTEXT",
        "torch._C.TensorBase._version",
        "torch._C.StorageBase._cdata",
    )


def dataflow_names_found() -> bool:
    """Whether the dataflow planner can observe a forward on this torch. The dispatch stack
    calls are looked up (each missing one warned about) now too, though an observation is
    left without them (:func:`leave_dispatch_mode`)."""
    _found(*_DISPATCH_STACK_CALLS)
    return _found("torch.utils._python_dispatch.TorchDispatchMode", "torch._C.StorageBase._cdata")


def checker_names_found() -> str | None:
    """The first private name the race checker needs that this torch lacks, or ``None``."""
    for path in (
        "torch.utils._python_dispatch.TorchDispatchMode",
        "torch._C._current_autograd_node",
        "torch.autograd.Variable._execution_engine",
        "torch._C._autograd._get_sequence_nr",
        "torch._C._functions.AccumulateGrad._sequence_nr",
    ):
        if private(path) is None:
            return path
    return None


@functools.cache  # asked per forward: looked up once
def accumulator_lookups_work() -> bool:
    """Whether gradient accumulators can be looked up and released on this torch."""
    return _found(
        "torch.utils._python_dispatch._disable_current_modes",
        "torch._C.DisableTorchFunction",
        "torch._C._are_functorch_transforms_active",
        "torch._C._functions.AccumulateGrad._input_metadata",
    )


# The base class of ooo_wrap's dispatch modes (``_planner/intercept.py``). A class
# statement needs it as that module is imported, so it is read then, guarded: where torch
# has none, a stand-in that cannot be entered takes its place, and every user asks
# :func:`dataflow_names_found` or :func:`checker_names_found` (which warn) before entering.
class _NoDispatchMode:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> None:
        raise RuntimeError("this torch has no torch.utils._python_dispatch.TorchDispatchMode")

    def __exit__(self, *args: Any) -> None:
        pass


if TYPE_CHECKING:
    from torch.utils._python_dispatch import TorchDispatchMode as DispatchModeBase
else:
    DispatchModeBase = getattr(
        getattr(torch.utils, "_python_dispatch", None), "TorchDispatchMode", _NoDispatchMode
    )


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
    eval_frame = "torch._dynamo.eval_frame"
    optimized = private(f"{eval_frame}.OptimizedModule", if_imported=eval_frame)
    return optimized is not None and isinstance(model, optimized)


def is_fsdp_managed(module: nn.Module) -> bool:
    """Whether ``fully_shard`` (FSDP2) manages ``module``'s parameters: it sets the private
    ``_is_fsdp_managed_module`` on every module it manages (for Dynamo); read from the
    instance's ``__dict__``, so a torch that renames it reads ``False``."""
    return bool(vars(module).get("_is_fsdp_managed_module", False))


def is_checkpoint_early_stop(error: BaseException) -> bool:
    """Whether ``error`` is how non-reentrant ``torch.utils.checkpoint`` ends a recomputation.

    Once backward has every tensor it needs, checkpoint stops recomputing by raising the
    private ``torch.utils.checkpoint._StopRecomputationError`` through the module being
    recomputed (a stage, when checkpoint wraps one) and catching it itself: control flow,
    not a stage failure. If the module was never imported, no checkpoint is running.
    """
    checkpoint = "torch.utils.checkpoint"
    stop = private(f"{checkpoint}._StopRecomputationError", if_imported=checkpoint)
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
    Without the name (or if it is no class), nothing changes and it is warned about.
    """
    original = private("torch.utils.checkpoint._checkpoint_hook")
    if not isinstance(original, type):
        if original is not None:
            _missing("torch.utils.checkpoint._checkpoint_hook")
        return False
    module: Any = sys.modules["torch.utils.checkpoint"]
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


def device_live_bytes(device: torch.device) -> int:
    """The bytes tensors occupy on ``device`` now (the caching allocator's allocated bytes).

    ``torch.accelerator.memory_allocated`` is new in torch 2.9; without it only CUDA can
    be asked (``torch.cuda.memory_allocated``), and other devices say 0.
    """
    query = getattr(torch.accelerator, "memory_allocated", None)
    if query is not None:
        return int(query(device))
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return 0


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
    (added with it). Without both, nothing changes (a setter without the getter is warned
    about).
    """
    setter = getattr(torch.autograd.graph, "set_override_stale_capture_stream", None)
    getter = None if setter is None else private("torch._C._override_stale_capture_stream")
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
    wrapped = _once("torch._C._functorch.is_functorch_wrapped_tensor")
    functional = _once("torch._C._functorch.is_functionaltensor")
    unwrap = _once("torch._C._functorch.get_unwrapped")
    if wrapped is None or functional is None or unwrap is None:
        return None
    inner = tensor
    while wrapped(inner) or functional(inner):
        unwrapped: torch.Tensor = unwrap(inner)
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
    node: Node | None = _once("torch._C._current_autograd_node")()
    return node


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the graph task now running ends (where the engine syncs the
    caller's stream with the leaf streams).

    The engine's own end-of-backward hook, ``Variable._execution_engine.queue_callback``
    (private; what DDP and FSDP use).
    """
    engine: Any = _once("torch.autograd.Variable._execution_engine")
    engine.queue_callback(callback)


def autograd_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread will get.

    ``torch._C._autograd._get_sequence_nr`` (private; the profiler's, which matches ops to
    nodes the same way).
    """
    return int(_once("torch._C._autograd._get_sequence_nr")())


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
    disable_modes = private("torch.utils._python_dispatch._disable_current_modes")
    with disable_modes(), private("torch._C.DisableTorchFunction")():
        yield


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (``vmap``, ``torch.func.grad``) is running on this
    thread: ``torch._C._are_functorch_transforms_active`` (private; no public query)."""
    query = private("torch._C._are_functorch_transforms_active")
    # Unknown without it: say "active", so that what steps aside under a transform (the
    # weight-gradient split) does; the accumulators ask accumulator_lookups_work() first.
    return True if query is None else bool(query())


# --- the thread's function mode stack, below its top -----------------------------------
#
# ``TorchFunctionMode`` is public (``torch.overrides``), but a mode entered with ``with``
# leaves by popping the top of the thread's mode stack, whichever mode that is. The
# deferred joins' mode (``_runtime/deferred.py``) is put on and taken off outside any
# ``with``, so it must never be on top of a user's mode, and the stack has no public API
# to insert or remove below the top. The private ``torch._C`` stack functions are the ones
# ``torch.overrides`` and ``torch.utils._device`` use to the same end; they are looked up
# once, by the first deferred join (a wrap asks :func:`deferred_joins_work` first).


_STACK_CALLS = (
    "torch._C._len_torch_function_stack",
    "torch._C._get_function_stack_at",
    "torch._C._pop_torch_function_stack",
    "torch._C._push_on_torch_function_stack",
)


_stack: list[Callable[..., Any]] = []


def _function_stack() -> list[Callable[..., Any]]:
    """length, get_at, pop, push: torch._C's function mode stack calls."""
    if not _stack:
        _stack.extend(_once(path) for path in _STACK_CALLS)
    return _stack


# The parameters of ``TorchFunctionMode.__torch_function__``, which every mode declares.
ModeFunc = Callable[..., Any]
ModeTypes = Sequence[type]
ModeArgs = Sequence[Any]
ModeKwargs = Mapping[str, Any] | None


def function_mode_position(mode: object) -> int | None:
    """Where ``mode`` is on this thread's function mode stack (0: the bottom), if it is."""
    length, get_at, _, _ = _function_stack()
    for index in range(length()):
        if get_at(index) is mode:
            return index
    return None


def take_function_mode_off(mode: object) -> None:
    """Remove ``mode`` from the stack, leaving every other mode where it was."""
    index = function_mode_position(mode)
    if index is None:
        return  # someone else took it off already
    length, _, pop, push = _function_stack()
    above = [pop() for _ in range(length() - index)]
    for other in reversed(above):
        if other is not mode:
            push(other)


def put_function_mode_under(mode: TorchFunctionMode) -> None:
    """Push ``mode`` below every mode on the stack (but the default device's): a user's
    ``with`` block then pops its own mode when it ends, and its ops reach ours after
    its mode ran."""
    length, get_at, pop, push = _function_stack()
    depth = length()
    # ``torch.set_default_device`` keeps its mode at the very bottom (kept on the private
    # ``torch._GLOBAL_DEVICE_CONTEXT``) and asserts it is there when the default changes:
    # ours goes just above that one. A ``with torch.device(...)`` block's mode is pushed on
    # top and popped from the top like a user's, so ours goes under it.
    default = getattr(private("torch._GLOBAL_DEVICE_CONTEXT"), "device_context", None)
    bottom = 1 if depth and default is not None and get_at(0) is default else 0
    above = [pop() for _ in range(depth - bottom)]
    push(mode)
    for other in reversed(above):
        push(other)


# --- names torch's own code reads on instances ---------------------------------------------
#
# Module hook dicts, a module's ``_modules`` key, a hook handle's dict references and an op's
# ``_schema`` are read by torch itself on every module call, hook removal and dispatch: torch
# cannot rename one without renaming its own reads, and none can be hidden from a running
# torch. The accessors below are their one reading place; tests/project/test_compat_names.py
# checks that the installed torch has each.

# An op's schema: its arguments, which it writes (``OpOverload._schema``; no public API).
op_schema: Callable[[Any], Any] = operator.attrgetter("_schema")

# A tensor's version counter, bumped by each in-place write (``Tensor._version``). An
# ``attrgetter``: the deferred joins read it per stage input, with no Python frame per read.
tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def next_hook_id() -> int:
    """The id the next hook registration in this process will get (``RemovableHandle.next_id``,
    a class attribute torch bumps per handle)."""
    return int(RemovableHandle.next_id)


def handle_dicts(handle: RemovableHandle) -> tuple[dict[Any, Any] | None, list[dict[Any, Any]]]:
    """The hook dict ``handle`` removes its hook from (``None`` once that is gone), and the
    extra dicts (``with_kwargs``, ``always_call``) that hold its id too
    (``RemovableHandle.hooks_dict_ref`` and ``extra_dict_ref``, weak references)."""
    extra = [d for ref in handle.extra_dict_ref if (d := ref()) is not None]
    return handle.hooks_dict_ref(), extra


def hook_dicts(module: nn.Module) -> list[dict[Any, Any]]:
    """Every hook dict of ``module`` (forward, backward, state dict...): its private
    attributes named ``_*_hooks*`` that hold a dict."""
    return [
        value
        for key, value in vars(module).items()
        if key[:1] == "_" and "_hooks" in key and isinstance(value, dict)
    ]


# --- containers registered with torch's pytree ----------------------------------------------


def pytree_nodes() -> Mapping[type, Any]:
    """``torch.utils._pytree.SUPPORTED_NODES``: each registered container type, with its
    ``flatten_fn`` and ``unflatten_fn`` (empty where this torch has none). PyTorch has no
    public pytree module; this is the only registry of user container types
    (``register_pytree_node``), the one torch.compile, FSDP and torch.export use."""
    nodes = private("torch.utils._pytree.SUPPORTED_NODES")
    return nodes if isinstance(nodes, Mapping) else {}


# --- FLOP formulas ------------------------------------------------------------------------


def flop_formulas() -> tuple[Mapping[Any, Any], Any]:
    """``torch.utils.flop_counter``'s formula table (keyed by overload packet), and the code
    object shared by the formulas its ``shape_wrapper`` wraps (``None`` if unknown).

    Not underscored, but internal: no documented API hands out one op's formula. Empty
    where this torch has no table (each op then counts no FLOPs).
    """
    registry = private("torch.utils.flop_counter.flop_registry")
    wrapper = private("torch.utils.flop_counter.shape_wrapper")
    if not isinstance(registry, Mapping):
        return {}, None
    # A table that changed shape would count 0 FLOPs for every op, silently: mm's formula,
    # called as the cost model calls it, must count a (2, 3) @ (3, 4) product's 48.
    try:
        mm: Any = registry[torch.ops.aten.mm]
        formula: Any = getattr(mm, "__wrapped__", mm)
        shapes = torch.Size([2, 3]), torch.Size([3, 4])
        counted = int(formula(*shapes, out_shape=torch.Size([2, 4])))
    except Exception:
        counted = 0
    if counted != 48:
        _missing("torch.utils.flop_counter.flop_registry", "has a changed")
        return {}, None
    code = getattr(wrapper(lambda: 0), "__code__", None) if callable(wrapper) else None
    return registry, code


# --- module calls on the Python stack -------------------------------------------------------
#
# ``nn.Module.__call__`` runs in a frame whose local ``self`` is the module. Its code object
# is found once by calling a probe module and walking up from its forward (the outermost
# frame holding the probe as ``self``), rather than read from a private attribute.

_call_code: list[Any] = []


def _module_call_code() -> Any:
    """The code object of the frame each module call runs in, or ``None`` if not found."""
    if not _call_code:

        class _Probe(nn.Module):
            def forward(self) -> Any:
                found, frame = None, inspect.currentframe()
                while frame is not None:
                    own = frame.f_code is _Probe.forward.__code__
                    if not own and frame.f_locals.get("self") is self:
                        found = frame.f_code
                    frame = frame.f_back
                return found

        _call_code.append(_Probe()())
    return _call_code[0]


def streaming_names_found() -> bool:
    """Whether this torch has what running stages on side streams safely needs, but the
    checkpoint hook (``_runtime/recompute.py`` installs that): the stage hooks see every
    tensor in a pytree container, and stale calls are told from running ones."""
    return _found("torch.utils._pytree.SUPPORTED_NODES") and module_calls_visible()


def module_calls_visible() -> bool:
    """Whether :func:`module_calls_on_stack` can see module calls on this torch (warns if not)."""
    if _module_call_code() is not None:
        return True
    if "nn.Module.__call__" not in _warned:
        _warned.add("nn.Module.__call__")
        warnings.warn(
            f"ooo_wrap: on this torch ({torch.__version__}) no frame of a module call holds "
            f"the module as `self`; {_PLAIN}. Please report it with your torch version",
            stacklevel=3,
        )
    return False


def module_calls_on_stack() -> Counter[int]:
    """How many calls of each module (by id) run on this thread's Python stack."""
    executing: Counter[int] = Counter()
    code = _module_call_code()
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is code:
            executing[id(frame.f_locals.get("self"))] += 1
        frame = frame.f_back
    return executing


def module_call_frame(module: nn.Module) -> FrameType | None:
    """The innermost frame of a call of ``module`` on this thread's Python stack, if any."""
    code = _module_call_code()
    frame = inspect.currentframe()
    while frame is not None and code is not None:
        if frame.f_code is code and frame.f_locals.get("self") is module:
            return frame
        frame = frame.f_back
    return None


# --- threads (Python's, not torch's) ------------------------------------------------------


def thread_target(thread: Any) -> Callable[..., Any] | None:
    """The function ``threading.Thread.run`` will call (its private ``_target``), if any."""
    target = getattr(thread, "_target", None)
    return target if callable(target) else None


def replace_thread_target(thread: Any, target: Callable[..., Any]) -> None:
    """Make ``thread.run`` call ``target`` instead (before it looked its target up)."""
    thread._target = target


# --- the thread's dispatch mode stack, below its top -----------------------------------


_DISPATCH_STACK_CALLS = (
    "torch._C._len_torch_dispatch_stack",
    "torch._C._get_dispatch_stack_at",
    "torch._C._pop_torch_dispatch_stack",
    "torch._C._push_on_torch_dispatch_stack",
)


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
    the top, as the end of a ``with`` block would (each missing one warned about once).
    """
    length, at, pop, push = [private(path) for path in _DISPATCH_STACK_CALLS]  # warn for each
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
