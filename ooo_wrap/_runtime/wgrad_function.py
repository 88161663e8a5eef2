"""The autograd side of the weight-gradient split: the pass-through node and the split
node of one layer call, and their synchronization points.

The numbered steps are those of the protocol in ``wgrad.py``; each synchronization point is
one small function, so that a mutation test can remove exactly one and show that the race
checker catches it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from .backend import Backend, Event, Stream
from .wgrad_layers import SplitRule

__all__ = ["LayerCall", "SplitState", "run_split"]


class SplitState(Protocol):
    """What a split node needs of its model's split (``wgrad.WeightGradSplit``)."""

    backend: Backend

    def step_aside(self, reason: str) -> None: ...

    def dw_launched(self, device: torch.device, stream: Stream, held: int) -> list[Event]: ...


class LayerCall(NamedTuple):
    """What one split layer call runs with, besides its tensors."""

    split: SplitState  # the model's split
    rule: SplitRule  # the layer's forward, dI and dW formulas
    layer: nn.Module
    stream: Stream  # the weight-gradient stream ``W`` of the layer's device


def run_split(call: LayerCall, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """One split layer call (steps 1 and 2) on the current stream ``A``; ``None`` where
    autocast's cast of a parameter cannot be reached (the caller runs the stock layer)."""
    split, stream = call.split, call.stream
    backend, device = split.backend, weight.device
    ambient = backend.current_stream(device)
    dtype = (
        torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    )
    params = (weight,) if bias is None else (weight, bias)
    cast = dtype is not None and any(_casts(p, dtype) for p in params)
    if dtype is not None:
        x = _autocast(x, dtype)
    if cast:
        # 1a. Under autocast the casts run on W, in forward: W first waits on A (the
        # parameters' last writes, an optimizer step's, were queued there).
        _fork_casts(backend, stream, ambient)
    # 1. Autocast's own casts (made now on W, unless its cache holds them) and the
    # pass-through node, made on W.
    backend.set_stream(_handoff_stream(stream, ambient))
    try:
        inputs: tuple[Tensor | None, ...] = params
        if dtype is not None:
            inputs = tuple(_cached_cast(call, x, p, dtype, p is weight) for p in params)
        missing = any(t is None for t in inputs)
        passed = None if missing else _apply(_Handoff, *inputs)
    finally:
        backend.set_stream(ambient)
    if cast:
        # 1b. A reads the casts (the layer's forward, then its dI); they were allocated
        # on W (or wherever autocast cached them) and autocast's cache or the split node
        # keeps them alive.
        _join_casts(backend, stream, ambient, [t for t in inputs if t is not None])
    if passed is None:
        return None
    handed: tuple[Tensor, ...] = (passed,) if bias is None else passed
    handed_w, handed_b = handed[0], (handed[1] if bias is not None else None)
    # 2. The split node, made on A.
    out: Tensor = _apply(_Split, call, x, handed_w, handed_b, cast)
    return out


def _cached_cast(
    call: LayerCall, x: Tensor, param: Tensor, dtype: torch.dtype, is_weight: bool
) -> Tensor | None:
    """``param`` as a lower-precision op under autocast reads it: autocast's cast through
    its weight cache, which for the rest of its region serves a cast made before an
    in-place update (an optimizer step inside the region), as stock layers read it.

    PyTorch has no call that returns that cast: an op that reads ``param`` runs on an
    empty input that requires grad, and the cast is the tensor its node saves. A 1-D or
    2-D parameter goes through ``matmul``, a weight of more dimensions through the layer's
    own forward on an empty batch. ``None`` if no such tensor was saved.
    """
    if not _casts(param, dtype):
        return param
    seen: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        seen.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
        if param.dim() <= 2:
            empty = torch.empty(0, param.shape[0], dtype=dtype, device=param.device)
            torch.matmul(empty.requires_grad_(), param)
        elif is_weight and x.is_floating_point() and x.dim() > 0:
            try:
                call.rule.forward(call.layer, x[:0].detach().requires_grad_(), param, None)
            except (RuntimeError, ValueError):
                return None  # a forward that refuses an empty batch: the layer runs stock
    for saved in seen:
        if saved.shape == param.shape and saved.dtype == dtype:
            return saved
    return None


def _unpack(t: Tensor) -> Tensor:
    return t  # never called: the graph of the op that saved it is dropped unused


# The synchronization points, one function each (the mutation tests remove each one and
# show the race checker catches it).


def _handoff_stream(stream: Stream, ambient: Stream) -> Stream:
    """1. The stream the pass-through node is made on: the weight-gradient stream."""
    return stream


def _fork_casts(backend: Backend, stream: Stream, ambient: Stream) -> None:
    """1a. ``W`` waits on an event recorded on ``A`` now, before autocast's casts run on it."""
    backend.wait_event(stream, backend.record_event(ambient))


def _join_casts(backend: Backend, stream: Stream, ambient: Stream, casts: Iterable[Tensor]) -> None:
    """1b. ``A`` waits on the casts, and each gets ``record_stream(A)``."""
    backend.wait_event(ambient, backend.record_event(stream))
    _protect(backend, casts, ambient)


def _protect(backend: Backend, tensors: Iterable[Tensor], stream: Stream) -> None:
    """3. ``record_stream(W)`` for each tensor ``W`` reads in backward."""
    for tensor in tensors:
        backend.record_stream(tensor, stream)


def _order_after(backend: Backend, stream: Stream, ambient: Stream) -> None:
    """3. ``W`` waits on an event recorded on ``A`` now (the output gradient is ready)."""
    backend.wait_event(stream, backend.record_event(ambient))


def _catch_up(backend: Backend, ambient: Stream, events: Iterable[Event]) -> None:
    """6. ``A`` waits on the pending dW beyond the byte budget."""
    for event in events:
        backend.wait_event(ambient, event)


def _apply(function: type[torch.autograd.Function], *args: Any) -> Any:
    """``function.apply(*args)`` (untyped in torch)."""
    return function.apply(*args)  # type: ignore[no-untyped-call]


def _casts(t: Tensor, dtype: torch.dtype) -> bool:
    """Whether autocast casts ``t`` for a lower-precision op (``cached_cast``: floating
    point but not double, if its dtype differs)."""
    return t.is_floating_point() and t.dtype not in (torch.float64, dtype)


def _autocast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` as autocast casts the arguments of a lower-precision op."""
    return t.to(dtype) if _casts(t, dtype) else t


class _Handoff(torch.autograd.Function):
    """The pass-through node of step 1: hands the parameters' gradients on from ``W``."""

    @staticmethod
    def forward(ctx: Any, *params: Tensor) -> Any:
        views = tuple(p.view_as(p) for p in params)
        return views[0] if len(views) == 1 else views

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        return grads[0] if len(grads) == 1 else grads


class _Split(torch.autograd.Function):
    """One split layer call: the stock forward; dI on its own stream, dW on ``W``."""

    @staticmethod
    def forward(
        ctx: Any, call: LayerCall, x: Tensor, weight: Tensor, bias: Tensor | None, cast: bool
    ) -> Tensor:
        ctx.split, ctx.rule, ctx.stream = call.split, call.rule, call.stream
        ctx.layer = weakref.ref(call.layer)
        # What the engine checks dW and db against: the tensors handed in (cast, under
        # autocast, as the cast's own node then converts on W).
        ctx.bias_like = None if bias is None else _Like.of(bias)
        ctx.weight_cast = cast  # the weight saved is a cast: held by dW like x (6.)
        ctx.save_for_backward(x, weight)
        return call.rule.forward(call.layer, x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        split: SplitState = ctx.split
        rule: SplitRule = ctx.rule
        layer = ctx.layer()
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[1:4]
        if layer is None:
            raise RuntimeError("ooo_wrap: a split layer was freed before its backward ran")
        if torch.is_grad_enabled():
            # create_graph=True: differentiable and inline, so double backward is stock.
            split.step_aside("create_graph")
            inline_dx = rule.input_grad(layer, grad, x, weight) if need_x else None
            inline_dw, inline_db = rule.weight_grads(layer, grad, x, weight, need_b)
            return (None, inline_dx, inline_dw if need_w else None, inline_db, None)
        backend, stream = split.backend, ctx.stream
        ambient = backend.current_stream(weight.device)
        if need_w or need_b:
            # 3. W reads grad and the saved tensors: keep their blocks from A's reuse,
            # then order W after everything queued on A so far (grad is ready there).
            _protect(backend, (grad, x, weight), stream)
            _order_after(backend, stream, ambient)
        # 4. dI on A, on the critical path; then dW (and db) on W.
        dx = rule.input_grad(layer, grad, x, weight) if need_x else None
        dw: Tensor | None = None
        db: Tensor | None = None
        if need_w or need_b:
            backend.set_stream(stream)
            try:
                w_grad, b_grad = rule.weight_grads(layer, grad, x, weight, need_b)
                dw = _like(w_grad, _Like.of(weight)) if need_w else None
                db = _like(b_grad, ctx.bias_like) if need_b and b_grad is not None else None
                held = _held_bytes((grad, x, weight) if ctx.weight_cast else (grad, x))
                late = split.dw_launched(weight.device, stream, held)
            finally:
                backend.set_stream(ambient)
            # 6. A waits on the pending dW beyond the budget (with it, dI and dW overlap).
            _catch_up(backend, ambient, late)
        # 5. The engine hands dW to the pass-through node, on W.
        return (None, dx, dw, db, None)


def _held_bytes(tensors: Iterable[Tensor]) -> int:
    """6. The bytes a pending dW keeps alive beyond its layer's backward: the storages of
    ``tensors``, each once (``nbytes`` of the whole storage, an upper bound where a tensor
    is a view that something else keeps alive too)."""
    seen = set()
    held = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    return held


class _Like(NamedTuple):
    """The dtype and strides a gradient must have (those of the tensor handed in)."""

    dtype: torch.dtype
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: Tensor) -> _Like:
        return cls(t.dtype, t.stride())


def _like(grad: Tensor, like: _Like) -> Tensor:
    """``grad`` in ``like``'s dtype and strides, converted on the current stream (``W``):
    the engine would otherwise convert it on the layer's stream, unordered with ``W``."""
    if grad.dtype != like.dtype:
        grad = grad.to(like.dtype)
    if grad.stride() != like.stride:
        out = torch.empty_strided(grad.shape, like.stride, dtype=grad.dtype, device=grad.device)
        grad = out.copy_(grad)
    return grad
