"""Gradient accumulators made on the streams each forward runs on.

Autograd makes a leaf's ``AccumulateGrad`` node the first time a differentiable op uses the
leaf (``impl::grad_accumulator`` in ``torch/csrc/autograd/variable.cpp``); its constructor
records the leaf's input metadata, the current stream included, and the engine accumulates
the leaf's gradient on that stream. The node is cached in the leaf *weakly*: a new one is
made only once every graph holding the old one is gone. The usual loop
(``loss = model(x).sum(); loss.backward()``) keeps the previous step's ``loss``, and so its
accumulators, alive through the next forward. So a forward that runs inline on the
caller's stream (the dataflow planner's learning step, measured tuning's plain steps,
``ooo_wrap.disabled()``) would bind its accumulators to the caller's stream for every later
planned step (the caller's stream then waits on each stage's gradients, torch >= 2.9 warns
"The AccumulateGrad node's stream does not match"), and a planned step would bind them to
the stages' streams for a later inline one.

So when a forward of the wrapped model runs on other streams than the previous one
(:meth:`Accumulators.begin`, before any op of it), the accumulators the wrapper's own
earlier forwards made are *released*: the leaf forgets them, and the forward makes new ones
where it first uses each parameter, as a loop that drops its graph would. Nothing else
changes: hooks (``register_hook``, ``register_post_accumulate_grad_hook``) live on the
parameter and ``.grad`` on the leaf, so the new node runs them all; an older graph still
holding a released node accumulates into the same ``.grad`` if it is run again. Only
``autograd.grad(old_loss, p)`` (or ``old_loss.backward(inputs=[p])``) on a graph made before
the release no longer reaches ``p``: the engine finds a leaf's node through the leaf.

Accumulators that existed before the wrapper's first forward (``DistributedDataParallel``
takes each one when it is constructed and keeps hooks on it) are never released: they are
marked foreign when first seen, and only nodes marked with this wrapper's token are
released.

PyTorch has no public API to read or drop a leaf's cached accumulator, so both are done
here, and only here: ``Tensor.data`` assignment drops it when the dtype changes
(``VariableHooks::set_data``: "Resets gradient accumulator if metadata is out of date"),
the node's recorded input shape (``_compat.first_input_shape``) tells a cached node from
one made by the look-up itself, the look-ups run with the thread's modes set aside
(``_compat.modes_set_aside``), and none runs under a functorch transform
(``_compat.functorch_transforms_active``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node, get_gradient_edge

from .._compat import (
    accumulator_lookups_work,
    first_input_shape,
    functorch_transforms_active,
    modes_set_aside,
    node_metadata,
)

__all__ = ["Accumulators", "Layout"]

# How a forward lays out its streams: "inline" (the caller's only), else a plan's name.
Layout = str

_KEY = "ooo_wrap.accumulator"
_FOREIGN = "foreign"  # the mark of an accumulator made before the wrapper's first forward
_RAN = "ooo_wrap.accumulator_ran"  # whether one of ours has run (its backward happened)


class Accumulators:
    """The accumulator bookkeeping of one wrapped model (no reference to the model).

    Looking up and releasing an accumulator briefly sets ``param.data`` to another tensor,
    which another thread using the parameters at that moment would see. So this is done
    only while one thread has ever run the model: a second thread's first forward (any
    forward that reaches a hook of the wrapper, training or not, planned, learning or
    plain: :meth:`enter`) waits for a look-up underway to finish, then turns the releases
    off for good (accumulators are then left as autograd makes them, as without the
    wrapper).
    """

    def __init__(self) -> None:
        self._layout: Layout | None = None
        self._token = object()  # the mark of this wrapper's own accumulators
        self._marking = False
        self._lock = threading.Lock()
        self._retry = False  # some of ours were kept (backward not run yet): try again
        self._thread: int | None = None  # the one thread that ran the model, while one did
        self._shared = False  # several threads ran it: leave accumulators alone

    def enter(self) -> None:
        """Before any op of a forward of the model on this thread: a thread other than the
        first waits for a look-up underway, and none is made again."""
        thread = threading.get_ident()
        if thread != self._thread:
            with self._lock:
                if self._thread is None:
                    self._thread = thread
                elif self._thread != thread:
                    self._shared = True

    def begin(self, model: nn.Module, layout: Layout) -> None:
        """Before any op of a training forward that runs with ``layout``: if the previous
        one ran with the other, release the accumulators the wrapper's forwards made."""
        self.enter()
        if self._shared or (layout == self._layout and not self._retry) or not _can_make_nodes():
            return
        # No mode sees the look-ups: they are no op of the model (a race checker or
        # profiler mode would count them, and might keep their outputs).
        with self._lock, modes_set_aside():
            if self._shared:
                return
            # The previous switched forward's end() did not run (its root post-hook was
            # not reached): what is unmarked now was made by it, so is ours.
            unmarked_ours = self._marking
            self._layout = layout
            self._marking = True
            self._retry = False
            for param in _parameters(model):
                try:
                    node = _cached(param)
                    if node is None:
                        continue
                    metadata = node_metadata(node)
                    owner = metadata.get(_KEY)
                    if owner is self._token and not metadata.get(_RAN, False):
                        # Its backward has not run yet: a graph this step builds on (two
                        # forwards, one loss) still needs it, and a second accumulator
                        # for the same .grad on another stream would race with it. Kept
                        # for now (correct, on the old stream); released at the next
                        # forward after its backward ran.
                        self._retry = True
                    elif owner is self._token or (owner is None and unmarked_ours):
                        _release(param)
                    elif owner is None:
                        metadata[_KEY] = _FOREIGN  # here before us: never ours
                except RuntimeError:
                    continue  # .data refused (a kind of tensor filtered out too late)

    def end(self, model: nn.Module) -> None:
        """After a forward that :meth:`begin` switched: mark the accumulators it made."""
        if not self._marking or not _can_make_nodes():
            return
        with self._lock, modes_set_aside():  # as in begin()
            self._marking = False
            if self._shared:
                return
            for param in _parameters(model):
                try:
                    node = _cached(param)
                except RuntimeError:
                    continue  # as in begin()
                if node is None:
                    continue
                metadata = node_metadata(node)
                if metadata.setdefault(_KEY, self._token) is self._token and (_RAN not in metadata):
                    metadata[_RAN] = False
                    node.register_hook(_ran(metadata))


def _ran(metadata: dict[str, Any]) -> Any:
    """A node hook noting in ``metadata`` that the node ran (it holds the dict, not the
    node: no reference cycle)."""

    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        metadata[_RAN] = True

    return hook


def _can_make_nodes() -> bool:
    """Whether this forward makes accumulators the wrapper may look up: not with gradients
    off, nor while ``torch.jit.trace`` records (the look-ups would be traced), nor under a
    functorch transform (``torch.func.grad``), whose nodes belong to wrapper tensors and
    which refuses ``.data`` assignment."""
    return (
        accumulator_lookups_work()
        and torch.is_grad_enabled()
        and not torch.is_inference_mode_enabled()
        and not torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call]
        and not functorch_transforms_active()
    )


def _parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """The plain dense parameters that take gradients (a tensor subclass's ``.data``, such
    as a sharded ``DTensor``'s, is left alone; a lazy module's before it initializes them
    has no accumulator)."""
    for param in model.parameters():
        if isinstance(param, nn.parameter.UninitializedParameter):
            continue
        plain = type(param.data) is torch.Tensor and param.layout == torch.strided
        if plain and param.requires_grad and param.is_leaf:
            yield param


def _cached(param: nn.Parameter) -> Node | None:
    """``param``'s cached accumulator, or ``None``; never leaves a new one cached.

    Looking the node up makes one if none is alive, so the look-up is made while
    ``param.data`` is an empty tensor of another shape (same dtype and device, so the
    cache is kept): a node made by the look-up records that shape, a cached one the real
    shape. A node made by the look-up is forgotten at once, even if something (a
    dispatch mode keeping the look-up's output) still holds it.
    """
    data = param.data
    probe = data.new_empty((0,) * (data.dim() + 1))
    param.data = probe
    try:
        node = get_gradient_edge(param).node
    finally:
        param.data = data
    if first_input_shape(node) == tuple(data.shape):
        return node
    _release(param)
    return None


def _release(param: nn.Parameter) -> None:
    """Make ``param`` forget its cached accumulator (its data, version and hooks kept).

    ``set_data`` to another dtype drops the cached node; setting the original data back
    restores every tensor attribute (storage, sizes, strides, dtype); the version counter
    and the autograd metadata (hooks, ``.grad``, ``requires_grad``) are the parameter's
    own and never change.
    """
    data = param.data
    other = torch.float32 if data.dtype == torch.float64 else torch.float64
    param.data = data.new_empty((0,), dtype=other)
    param.data = data
