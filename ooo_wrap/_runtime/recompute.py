"""Ordering what a non-reentrant checkpoint recomputes in backward, for whoever reads it.

Non-reentrant ``torch.utils.checkpoint`` recomputes its region inside the unpack hook of
the first backward node that unpacks one of the region's saved tensors, on that node's
stream ``r`` (the engine makes a node's stream current while it runs); each other node of
the region then unpacks its recomputed tensors on its own stream. The engine orders nodes
only along gradients, so a node on another stream (the caller's, for the region's own ops
such as ``a(x) * b(x)``; a stage's, for what the stage saved) may read what the
recomputation wrote on ``r``, or on a stage stream it forked to, with nothing in between;
and that memory goes back to the pool of the stream it was allocated on. When a stage call
runs inside the unpack hook (these are not steps of the per-stage-call protocol in
``scheduler.py``, whose steps 1-5 each recomputed stage call still runs):

- *The end event.* Each recomputed stage call forks from ``r`` and joins back into it
  (step 4, never deferred), or runs inline on ``r``, so an event ``e`` recorded on ``r``
  as the hook returns follows every op of the recomputation.
- *Each reader waits.* Every later unpack from that checkpoint, and this one, makes the
  unpacking node's stream wait on ``e`` (queued before the node's kernels, which run after
  it unpacks) and calls ``record_stream`` for that stream on the tensor: the checkpoint
  holds it until unpacked, the node after, and its block is not reused before this
  stream's reads are done.

Nothing here depends on the plan: wherever the forward's nodes and the recomputation ran,
each reader waits and records. Where no stage runs, the checkpoint's hook runs unchanged.

Reentrant ``torch.utils.checkpoint`` (``CheckpointFunction.backward``) recomputes inside
its own node, on that node's stream ``r``, from inputs it detaches into fresh leaves, runs
a nested ``backward()`` and returns each leaf's ``.grad`` to the engine as the node's
gradient. A stage called there (steps 1-5 again) forks onto ``s``; its backward runs on
``s``, and a leaf it reads first gets its ``AccumulateGrad`` on ``s``, which steals the
gradient made there: ``.grad`` is a block of ``s``'s pool, which the engine then treats as
made on ``r`` (the node's stream) and hands on with no ``record_stream``. So:

- *The leaf's gradient is recorded to ``r``.* Each such input leaf gets a
  post-accumulate-grad hook that calls ``record_stream(r)`` on its ``.grad``: the block is
  not reused by ``s`` before ``r``'s reads are done. The data is ordered already: the
  nested backward ends with ``r`` waiting on every leaf stream, ``s`` included.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._compat import UnpackHook, current_autograd_node, wrap_checkpoint_unpacks
from .backend import Backend, Stream
from .inflight import thread_state

__all__ = ["install", "order_unpacked", "record_leaf_grads"]

# The leaves given a hook by record_leaf_grads, by id while they live (one hook each).
_recorded: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def install() -> bool:
    """Route every non-reentrant checkpoint's unpacks through :func:`_ordered` from now on;
    returns whether this torch allows it (without, no model may stream)."""
    return wrap_checkpoint_unpacks(_ordered)


def _ordered(unpack: UnpackHook) -> UnpackHook:
    """``unpack``, one checkpointed call's, made to order each tensor for its reader."""
    # The end event of each recomputation that ran a stage, with its backend and device.
    ends: list[tuple[Backend, torch.device, Any]] = []

    def unpack_hook(holder: Any) -> torch.Tensor:
        local = thread_state
        outer = local.recomputing
        ran = local.recomputing = []
        try:
            tensor = unpack(holder)
        finally:
            local.recomputing = outer
        if ran:
            if outer is not None:
                outer += ran  # a recomputation run inside another's: it joined there too
            for backend, device in dict.fromkeys(ran):
                # The end event e follows the recomputation: its stage calls all joined r.
                ends.append((backend, device, backend.record_event(backend.current_stream(device))))
        if ends:
            order_unpacked(tensor, ends)
        return tensor

    return unpack_hook


def order_unpacked(tensor: torch.Tensor, ends: list[tuple[Backend, torch.device, Any]]) -> None:
    """Each reader waits: the unpacking node's stream waits on each end event, and
    ``record_stream`` for it."""
    for backend, device, event in ends:
        if tensor.device == device:
            stream = backend.current_stream(device)
            backend.wait_event(stream, event)
            backend.record_stream(tensor, stream)


def record_leaf_grads(inputs: list[torch.Tensor], backend: Backend, ambient: Stream) -> None:
    """A stage call inside a node's backward (reentrant checkpoint): each input leaf that
    requires grad gets its ``.grad`` recorded to ``ambient`` once accumulated."""
    if current_autograd_node() is None or not torch.is_grad_enabled():
        return  # not recomputing in backward: a direct call keeps .grad, as a parameter does
    for tensor in inputs:
        if tensor.requires_grad and tensor.is_leaf and _recorded.get(id(tensor)) is not tensor:
            _recorded[id(tensor)] = tensor
            hook = _record_grad(backend, ambient)
            tensor.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]


def _record_grad(backend: Backend, stream: Stream) -> Any:
    """A post-accumulate-grad hook: ``record_stream(stream)`` on the leaf's ``.grad``."""

    def hook(leaf: torch.Tensor) -> None:
        grad = leaf.grad
        if grad is not None and grad.layout == torch.strided:
            backend.record_stream(grad, stream)

    return hook
