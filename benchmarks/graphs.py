"""Whole-training-step CUDA graphs for the benchmark's graphed modes.

:func:`capture_step` captures one training step (forward, loss, backward, optimizer step)
with ``torch.cuda.graph`` and returns a :class:`GraphedStep` that replays it. It is the
benchmark's own, small and self-contained, so that the suite does not depend on the
library's graph helper; its calling convention is the same (``step(*args)`` copies
``args`` into the static buffers and replays), so the suite can switch to it later.

What a whole-step capture needs, in order:

1. Static input buffers: the sample arguments are cloned once; every call copies its
   arguments into them, because a replay reads the addresses it captured.
2. Warm-up on a side stream (``warmup`` eager steps, gradients cleared before each), so
   that lazy initialisation (cuBLAS handles, autocast state, the optimizer's momentum
   buffers, a learned plan) happens before capture, not in it.
3. ``zero_grad(set_to_none=True)`` just before capture: backward then allocates the
   gradients in the graph's private pool, and every replay overwrites them (no
   accumulation across replays). The optimizer must be capturable: SGD (its momentum
   buffers exist after the warm-up; the learning rate is a Python float, baked into the
   graph), or Adam/AdamW with ``capturable=True``.
4. Capture, then replay. A replay is asynchronous: the caller synchronizes to time it.

Without CUDA nothing is captured: :func:`capture_step` raises :class:`GraphCaptureError`,
and the suite reports the graphed mode as failed rather than timing an eager step under a
graphed name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import ooo_wrap

__all__ = ["GraphCaptureError", "GraphedStep", "capture_step", "graph_capture_bypasses"]

# The reason the wrapper gives for stage calls it ran inline because the current stream
# was capturing a graph (a ``BYPASSED`` event).
GRAPH_CAPTURE_REASON = "graph_capture"


class GraphCaptureError(RuntimeError):
    """The step could not be captured as a CUDA graph (no CUDA, or capture raised)."""


class GraphedStep:
    """A captured training step: calling it copies new arguments in and replays the graph.

    Attributes:
        captured: always ``True`` here (a step that cannot be captured raises instead);
            kept so that a caller can treat another helper's eager fallback alike.
        reason: why it was not captured; ``None`` when it was.
        output: the captured step's return value, in the graph's static memory.
    """

    captured = True
    reason: str | None = None

    def __init__(
        self, graph: torch.cuda.CUDAGraph, static_args: Sequence[torch.Tensor], output: Any
    ) -> None:
        self._graph = graph
        self._static_args = tuple(static_args)
        self.output = output

    def __call__(self, *args: torch.Tensor) -> Any:
        if len(args) != len(self._static_args):
            raise TypeError(f"expected {len(self._static_args)} arguments, got {len(args)}")
        for static, arg in zip(self._static_args, args, strict=True):
            if arg is not static:
                static.copy_(arg, non_blocking=True)
        self._graph.replay()
        return self.output


def capture_step(
    step_fn: Callable[..., Any],
    *sample_args: torch.Tensor,
    zero_grad: Callable[[], None],
    warmup: int = 3,
) -> GraphedStep:
    """Capture ``step_fn(*args)`` (forward, loss, backward, optimizer step) as one graph.

    Args:
        step_fn: one training step without clearing gradients; returns what the caller
            reads after a replay (the loss).
        sample_args: CUDA tensors of the shapes every later call passes; cloned into the
            static buffers.
        zero_grad: clears the gradients with ``set_to_none=True`` (called before each
            warm-up step and once before capture).
        warmup: eager steps on a side stream before capture (at least 1).

    Returns:
        The captured step; ``step(*args)`` copies ``args`` in and replays.

    Raises:
        GraphCaptureError: without CUDA, or when warm-up or capture raised (the message
            keeps the original error).
        torch.cuda.OutOfMemoryError: as it is, when warm-up or capture ran out of memory.

    Example::

        >>> step = capture_step(train_body, x, y, zero_grad=lambda: opt.zero_grad(True))
        >>> loss = step(x, y); torch.cuda.synchronize()
    """
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1, got {warmup}")
    if not torch.cuda.is_available():
        raise GraphCaptureError("CUDA graphs need a CUDA device; none is visible to PyTorch")
    devices = {arg.device.type for arg in sample_args}
    if devices != {"cuda"}:
        raise GraphCaptureError(f"sample arguments must be CUDA tensors, got {sorted(devices)}")
    static_args = [arg.detach().clone() for arg in sample_args]
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                zero_grad()
                step_fn(*static_args)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        zero_grad()
        with torch.cuda.graph(graph):
            output = step_fn(*static_args)
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        raise  # too big for this GPU: the suite reports it as such, not as a failure
    except Exception as error:
        raise GraphCaptureError(f"capture failed: {type(error).__name__}: {error}") from error
    return GraphedStep(graph, static_args, output)


def graph_capture_bypasses(model: nn.Module) -> int:
    """Stage calls the wrapper ran inline because their stream was capturing a graph.

    The sum of the counts of ``model``'s ``BYPASSED`` events with reason
    ``graph_capture``; 0 for a model that is not wrapped or never bypassed under capture.
    """
    return sum(
        event.count
        for event in ooo_wrap.events_for(model)
        if event.kind is ooo_wrap.EventKind.BYPASSED and event.reason == GRAPH_CAPTURE_REASON
    )
