"""See every aten op with its arguments and results: the eyes of the dataflow planner's
observer and of the race detector.

This is the only file in ooo_wrap that subclasses ``TorchDispatchMode`` (read in ``_compat``
as ``DispatchModeBase``, the rule for private names). PyTorch has no public
API that shows each aten op with its schema and the tensors it touches (forward and,
inside the autograd engine, backward alike); ``torch.cuda._sanitizer`` uses the same
private class for the same reason.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

from .._compat import DispatchModeBase, OpOverload, replace_thread_target, thread_target

__all__ = [
    "OpArgs",
    "OpHandler",
    "OpInterceptor",
    "OpKwargs",
    "OpOverload",
    "OpPrepare",
    "intercept_new_threads",
]

# An aten op as a dispatch mode sees it, the first parameters of every op callback here and
# in the race checker: the overload, its positional and its keyword arguments (and, once
# it ran, its result: ``Any``).
OpArgs = Sequence[Any]
OpKwargs = Mapping[str, Any]

# (op, args, kwargs, result, what prepare returned) -> None; called after the op ran.
OpHandler = Callable[[OpOverload, OpArgs, OpKwargs, Any, Any], None]
# (op, args, kwargs) -> anything; called before the op runs.
OpPrepare = Callable[[OpOverload, OpArgs, OpKwargs], Any]


# The base class is untyped in torch: its constructor hooks are the untyped calls.
class OpInterceptor(DispatchModeBase):  # type: ignore[no-untyped-call]
    """Runs every op unchanged, then reports it to ``handler`` (with what ``prepare``
    saw of its arguments before it ran)."""

    def __init__(self, handler: OpHandler, prepare: OpPrepare | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._handler = handler
        self._prepare = prepare

    def __torch_dispatch__(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: OpArgs = (),
        kwargs: OpKwargs | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        before = None if self._prepare is None else self._prepare(func, args, kwargs)
        out = func(*args, **kwargs)
        self._handler(func, args, kwargs, out, before)
        return out


@contextlib.contextmanager
def intercept_new_threads(handler: OpHandler, prepare: OpPrepare) -> Iterator[None]:
    """Threads started inside the block report their ops to ``handler`` too.

    A dispatch mode is per thread, so a thread the code under test starts would run
    unseen. ``threading.setprofile`` runs a function first thing in every new thread, as
    its ``run`` is called: it removes itself and makes the thread's target run inside an
    :class:`OpInterceptor`. After the block such a thread's interceptor only runs ops.

    The mode must be left before the thread ends: a mode still on a thread's stack is
    released with the thread's C++ state, which needs the interpreter, and when that
    happens while the interpreter finalizes the process aborts.
    """
    active = True

    def report(func: OpOverload, args: OpArgs, kwargs: OpKwargs, out: Any, before: Any) -> None:
        if active:
            handler(func, args, kwargs, out, before)

    previous = threading.getprofile()

    def start(frame: FrameType, event: str, arg: Any) -> None:
        sys.setprofile(previous)
        mode = OpInterceptor(report, prepare)
        thread: Any = threading.current_thread()
        target = thread_target(thread)
        if target is not None:
            # Thread.run has not looked up its target yet (this is its call event).
            replace_thread_target(thread, _seen(mode, target))
            return
        # A run() of its own: leave the mode when that frame returns.
        mode.__enter__()  # type: ignore[no-untyped-call]

        def leave(left: FrameType, event: str, arg: Any) -> None:
            if left is frame and event == "return":
                sys.setprofile(previous)
                mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]

        sys.setprofile(leave)

    threading.setprofile(start)
    try:
        yield
    finally:
        threading.setprofile(previous)
        active = False


def _seen(mode: OpInterceptor, target: Callable[..., Any]) -> Callable[..., Any]:
    """``target``, run inside ``mode``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return target(*args, **kwargs)

    return run
