"""Racing a tuning model's arms as CUDA graphs, for :func:`graphed_step`.

Nothing can be timed inside a capture, and eager step times do not apply to a replay
(a graph launches its kernels without the host). So where the library owns the capture,
each arm the model races (plain first, ``_wrapper/arms.py``) is captured in a graph of
its own, and each call of the graphed step replays the graph of the arm whose turn it
is between two timing marks on the caller's stream: a step of the user's loop on the
user's batch, whichever arm runs, so racing costs no extra step. The model's tuner
(``_wrapper/tune.py``) rotates the arms, counts the replays and decides, with the same
statistics and confirmation round as for eager steps. Once it decides, the model keeps
the winner's hooks (for its eager forwards), every call replays the winner's graph, and
the other graphs are freed.

Each graph holds a memory pool of its own: while racing, the step's memory is held once
per arm captured (``tune_arms`` bounds how many; an arm that leaves the race frees its
graph). A graph writes the gradients into buffers its capture allocated
(``zero_grad(set_to_none=True)``), so after each replay the raced model's ``.grad`` are
bound to the buffers of the arm replayed. Parameters of modules the wrapper does not
know (another model the step trains) keep the ``.grad`` of the last arm captured: read
their gradients inside the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from .._errors import OOOError
from .._events import EventKind, OOOEvent
from .._wrapper.arms import Arm
from .._wrapper.registry import graph_race_decided
from .._wrapper.tune import GRAPH, Tuner

__all__ = ["Capture", "GraphRace", "Replayable"]

logger = logging.getLogger("ooo_wrap")


class Replayable(Protocol):
    """A captured graph (``torch.cuda.CUDAGraph``)."""

    def replay(self) -> None: ...


# Capture the step once with the hooks now on the model (the arm held): its graph and the
# outputs the capture made. Each call warms the arm up eagerly first.
Capture = Callable[[], tuple[Replayable, Any]]


@dataclass
class _Captured:
    graph: Replayable
    outputs: Any
    grads: list[tuple[nn.Parameter, torch.Tensor | None]]


class GraphRace:
    """The arms of ``model``'s race, each captured by ``capture`` with its arm held."""

    def __init__(self, model: nn.Module, tuner: Tuner, capture: Capture) -> None:
        self._model, self._tuner, self._capture = model, tuner, capture
        self._graphs: dict[str, _Captured] = {}
        self.last: _Captured | None = None
        self.replaying = ""  # the arm replayed last
        try:
            for arm in tuner.arms:
                self._add(arm)
        except BaseException:
            tuner.hold(None)
            raise

    def _add(self, arm: Arm) -> None:
        self._tuner.hold(arm)
        try:
            graph, outputs = self._capture()
        except Exception as error:
            if arm.is_plain:
                raise  # the step itself cannot be captured: graphed_step says why
            # An arm that cannot be captured (or does not fit in memory) leaves the race.
            self._tuner.race.leave(arm)
            why = (
                f"the {arm.name} arm could not be captured in a CUDA graph "
                f"({type(error).__name__}: {error}); it left the race"
            )
            self._tuner.log.add(
                OOOEvent(EventKind.TUNED, "not_captured", why), level=logging.WARNING
            )
            return
        grads = [(p, p.grad) for p in self._model.parameters()]
        self._graphs[arm.name] = _Captured(graph, outputs, grads)

    @property
    def arms(self) -> tuple[str, ...]:
        """The arms captured, plain first."""
        return tuple(self._graphs)

    def replay(self) -> tuple[Any, bool]:
        """Replay the graph of the arm whose turn it is, timed; its outputs, and whether
        the race is decided now (then :meth:`winner` names the arm to capture for good)."""
        tuner = self._tuner
        arm, counted = tuner.race.next_turn(GRAPH)
        self.replaying = arm.name
        captured = self._graphs[arm.name]
        stream = tuner.backend.current_stream(tuner.device)
        start = tuner.clock.mark(stream)
        captured.graph.replay()
        end = tuner.clock.mark(stream)
        for param, grad in captured.grads:
            param.grad = grad
        self.last = captured
        if tuner.shared.world == 1:  # else rank 0 decides, maybe for an arm that left here
            for name in set(self._graphs) - {arm.name for arm in tuner.race.racing}:
                del self._graphs[name]  # left the race: its memory pool goes
        return captured.outputs, tuner.replayed(arm if counted else None, start, end)

    def winner(self) -> tuple[str, Replayable, Any]:
        """Apply the decision to the model (the winner's hooks, or none), free the other
        graphs; the arm kept, its graph and the outputs its replays rewrite."""
        decision = self._tuner.decision
        kept = self._graphs.get(decision)
        if kept is None:
            raise OOOError(
                f"every rank keeps rank 0's {decision} arm, but this rank could not capture "
                "it in a CUDA graph (a TUNED not_captured event says why); pin an arm with "
                "tune_arm=... so that every rank graphs the same one"
            )
        for param, grad in kept.grads:
            param.grad = grad
        self._graphs.clear()
        self.last = kept
        graph_race_decided(self._model)
        return decision, kept.graph, kept.outputs
