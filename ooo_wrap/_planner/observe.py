"""Watch one forward: the call tree of a model's modules, and what each op reads and writes.

Ops are seen through ``intercept.OpInterceptor``, the dispatch mode the race checker uses
too; module calls through ordinary forward hooks.

The record is a call tree, not a module tree: a module called twice appears twice. Each call
holds, in program order, its own ops and its child calls. Each op names the storages it
reads, writes in place and allocates, and carries an estimated device time from the cost
model (an estimate on a named reference GPU, never a measurement). Nothing here touches a
stream; the forward runs unchanged, on whatever device the model and inputs are on (the
``meta`` device works for models without data-dependent shapes).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from threading import get_ident
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._compat import leave_dispatch_mode, module_call_frame, storage_id
from .._tensors import tensors_in
from .cost import H200, ReferenceGPU, estimate_op
from .intercept import OpArgs, OpInterceptor, OpKwargs, OpOverload
from .schema import arguments

__all__ = ["CallRecord", "ObservedOp", "Observer", "observe"]

StorageKey = int
# (func, args, kwargs, out) -> estimated device µs of one op.
OpCostFn = Callable[[OpOverload, OpArgs, OpKwargs, Any], float]


@dataclass(frozen=True)
class ObservedOp:
    """One aten op: the storages it touched and its estimated device time (µs)."""

    name: str
    reads: tuple[StorageKey, ...]
    writes: tuple[StorageKey, ...]  # existing storages written in place (or ``out=``)
    fresh: tuple[StorageKey, ...]  # storages the op allocated (and wrote)
    device_us: float
    occupancy: float = 1.0  # fraction of the GPU its kernel fills (``cost.OpCost``)


@dataclass(frozen=True)
class CallRecord:
    """One module call: its items (ops and child calls) in program order.

    Attributes:
        name: the module's dotted name (its first name in ``named_modules()``; ``""`` for
            the root).
        call_id: position of this call in the forward (pre-order), unique in one record.
        items: the call's own ops and its child calls, in the order they ran.
        device_us: estimated device time of every op inside the call, children included.
        params: ``(numel, element size)`` of each parameter of the module itself that
            requires grad, on its first call only (what an optimizer step updates).
    """

    name: str
    call_id: int
    items: tuple[ObservedOp | CallRecord, ...]
    device_us: float
    params: tuple[tuple[int, int], ...] = ()

    @property
    def children(self) -> tuple[CallRecord, ...]:
        """The child calls, in order."""
        return tuple(item for item in self.items if isinstance(item, CallRecord))

    def ops(self) -> Iterator[ObservedOp]:
        """Every op inside this call, children included, in program order."""
        for item in self.items:
            if isinstance(item, ObservedOp):
                yield item
            else:
                yield from item.ops()

    def calls(self) -> Iterator[CallRecord]:
        """This call and every call inside it, in pre-order."""
        yield self
        for child in self.children:
            yield from child.calls()


def _storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """Which storage ``tensor`` uses, shared by its views (``None``: it has none).

    The StorageImpl (:func:`~ooo_wrap._compat.storage_id`), not the memory address: the
    observed forward may run on the ``meta`` device, where every address is 0. A reuse of
    a freed one shows up as a fresh allocation.
    """
    if tensor.layout != torch.strided or tensor.untyped_storage().nbytes() == 0:
        return None
    return storage_id(tensor)


def _uses(
    func: OpOverload, args: OpArgs, kwargs: OpKwargs, out: Any
) -> tuple[list[StorageKey], list[StorageKey], list[StorageKey]]:
    """(reads, in-place writes, fresh allocations) of one op, from its schema and the
    writes schemas leave out (``schema.arguments``)."""
    if func.is_view:  # a view launches no kernel and allocates nothing
        return [], [], []
    # Per storage, whether the op writes it: one passed both ways (``add(x, y, out=x)``) is.
    used: dict[StorageKey, bool] = {}
    for value, is_write in arguments(func, args, kwargs):
        for tensor in tensors_in(value):
            key = _storage_key(tensor)
            if key is not None:
                used[key] = used.get(key, False) or is_write
    reads = [key for key, written in used.items() if not written]
    writes = [key for key, written in used.items() if written]
    made = (_storage_key(tensor) for tensor in tensors_in(out))
    fresh = list(dict.fromkeys(key for key in made if key is not None and key not in used))
    return reads, writes, fresh


@dataclass
class _OpenCall:
    name: str
    call_id: int
    items: list[ObservedOp | CallRecord] = field(default_factory=list)
    device_us: float = 0.0
    params: tuple[tuple[int, int], ...] = ()
    lazy: bool = False  # the module had parameters to initialize when its call began


class Observer:
    """Context manager that records one forward of ``model`` as a :class:`CallRecord`.

    Hooks go on every sub-module for the duration of the ``with`` block only; they and the
    dispatch mode are removed on exit, even if the forward raised. ``record`` is the root
    call after a forward ran inside the block.

    With ``inside_root=True`` the block is entered from inside the root's own call (a
    forward pre-hook of the model, as the wrapper learns its plan) and left before that
    call returns (from its forward hook): the root's call is opened on entering and closed
    on leaving, instead of by hooks on the root. A ``BaseException`` such as
    ``KeyboardInterrupt`` skips the forward hook, and so the exit: the observer then
    notices at the next op or module call of its thread that the root's call is over
    (:attr:`interrupted`), records nothing more and removes its hooks; only ``__exit__``,
    on that thread, leaves the dispatch mode.

    Only the thread that entered the block is observed: other threads running the same
    modules meanwhile are not recorded.

    Example::

        >>> with Observer(model) as watch:
        ...     out = model(x)
        >>> watch.record.children
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        gpu: ReferenceGPU = H200,
        op_cost: OpCostFn | None = None,
        inside_root: bool = False,
    ) -> None:
        self._model = model
        self._inside_root = inside_root
        self._gpu = gpu
        self._op_cost = op_cost
        self._stack: list[_OpenCall] = []
        self._top: list[CallRecord] = []
        self._next_id = 0
        self._handles: list[RemovableHandle] = []
        self._mode: OpInterceptor | None = None
        self._seen_params: set[int] = set()
        self._thread = get_ident()  # the thread observed (set again on entering)
        # inside_root: the root's ``nn.Module`` call frame, while it may still run.
        self._root_frame: FrameType | None = None
        self._over = False  # the root's call ended without the exit: record nothing more

    @property
    def record(self) -> CallRecord:
        """The root call of the first forward seen (raises if none completed)."""
        if not self._top:
            raise RuntimeError("no forward of the model completed inside the Observer block")
        return self._top[0]

    @property
    def thread(self) -> int:
        """The thread observed (``threading.get_ident()``)."""
        return self._thread

    @property
    def interrupted(self) -> bool:
        """Whether the root's call (``inside_root``) ended without leaving the block: a
        ``BaseException`` skipped its forward hook. Another thread than the observed one
        only learns whether that thread ended."""
        root = self._root_frame
        if not self._over and root is not None:
            if get_ident() == self._thread:
                over = not _on_stack(root, sys._getframe(1))
            else:
                over = self._thread not in sys._current_frames()
            if over:
                self._stop()
        return self._over

    def __enter__(self) -> Observer:
        self._thread = get_ident()
        if self._inside_root:
            self._root_frame = module_call_frame(self._model)
        for name, module in self._model.named_modules():
            if self._inside_root and module is self._model:
                continue
            pre = module.register_forward_pre_hook(self._pre_hook(name), prepend=True)
            post = module.register_forward_hook(self._post_hook, always_call=True)
            self._handles += [pre, post]
        self._mode = OpInterceptor(self._record)
        try:
            self._mode.__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            self._remove_hooks()
            raise
        if self._inside_root:
            self._pre_hook("")(self._model, ())
        return self

    def __exit__(self, *exc: object) -> None:
        """Leave the block; from another thread than the observed one (or after the
        dispatch mode was left already) only the hooks come off."""
        try:
            if self._inside_root and len(self._stack) == 1 and not self._over:
                self._post_hook(self._model, (), None)  # the root call, and only it
            if self._mode is not None and get_ident() == self._thread:
                # Left wherever it is on the stack: after an interrupted forward a mode
                # entered since may be above it.
                leave_dispatch_mode(self._mode)
                self._mode = None
        finally:
            self._stop()

    def _stop(self) -> None:
        """Record nothing more and remove the hooks (the mode is left by ``__exit__``)."""
        self._over = True
        self._root_frame = None  # keeps the interrupted call's locals alive otherwise
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _mine(self) -> bool:
        """Whether a module call now belongs to the observed forward: on its thread, and
        while its root's call runs."""
        if self._over or get_ident() != self._thread:
            return False
        return not self.interrupted

    def _pre_hook(self, name: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self._mine():
                return
            params, lazy = self._new_params(module)
            self._stack.append(_OpenCall(name, self._next_id, params=params, lazy=lazy))
            self._next_id += 1

        return hook

    def _new_params(self, module: nn.Module) -> tuple[tuple[tuple[int, int], ...], bool]:
        """``(numel, element size)`` of the module's own parameters that take gradients,
        first seen now, and whether some are still to be initialized: a lazy module's
        (``nn.LazyLinear``) have no size until its own pre-hook, after this one,
        initializes them; they are counted as its call ends."""
        params, lazy = [], False
        for param in module.parameters(recurse=False):
            if isinstance(param, nn.parameter.UninitializedParameter):
                lazy = True
            elif param.requires_grad and id(param) not in self._seen_params:
                self._seen_params.add(id(param))
                params.append((param.numel(), param.element_size()))
        return tuple(params), lazy

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack or self._over or get_ident() != self._thread:
            return
        done = self._stack.pop()
        params = done.params + self._new_params(module)[0] if done.lazy else done.params
        record = CallRecord(done.name, done.call_id, tuple(done.items), done.device_us, params)
        if self._stack:
            self._stack[-1].items.append(record)
            self._stack[-1].device_us += record.device_us
        else:
            self._top.append(record)

    def _record(
        self, func: OpOverload, args: OpArgs, kwargs: OpKwargs, out: Any, before: object = None
    ) -> None:
        """File one op, after it ran, under the innermost open module call."""
        if not self._stack or self._over:  # an op outside any module call (building inputs)
            return
        # An op of the observed thread after its root's call was interrupted is none of
        # the forward's (the autograd engine's device threads run the thread's modes too).
        if get_ident() == self._thread and self.interrupted:
            return
        reads, writes, fresh = _uses(func, args, kwargs, out)
        occupancy = 1.0
        if self._op_cost is None:
            estimate = estimate_op(func, args, kwargs, out, self._gpu)
            cost, occupancy = estimate.device_us, estimate.occupancy
        else:
            cost = float(self._op_cost(func, args, kwargs, out))
        op = ObservedOp(str(func), tuple(reads), tuple(writes), tuple(fresh), cost, occupancy)
        self._stack[-1].items.append(op)
        self._stack[-1].device_us += cost


def _on_stack(target: FrameType, frame: FrameType | None) -> bool:
    """Whether ``target`` is ``frame`` or one of its callers (a walk up the stack: a few µs)."""
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False


def observe(
    model: nn.Module,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    gpu: ReferenceGPU = H200,
    op_cost: OpCostFn | None = None,
) -> CallRecord:
    """Run ``model(*args, **kwargs)`` once under observation and return its call tree.

    Args:
        model: the model; it runs unchanged (grad mode as the caller set it).
        args, kwargs: its inputs.
        gpu: the reference GPU the op costs are estimated for.
        op_cost: replaces the cost model (``(func, args, kwargs, out) -> µs``), for tests.

    Returns:
        The root :class:`CallRecord`.
    """
    with Observer(model, gpu=gpu, op_cost=op_cost) as watch:
        model(*args, **(kwargs or {}))
    return watch.record
