"""Racing a tuning model's arms as CUDA graphs, for :func:`graphed_step`.

Nothing can be timed inside a capture, and eager step times do not apply to a replay
(a graph launches its kernels without the host). So where the library owns the capture,
each arm the model races (plain first, ``_wrapper/arms.py``) is captured in a graph of
its own, and each call of the graphed step replays the graph of the arm whose turn it
is between two timing marks on the caller's stream: a step of the user's loop on the
user's batch, whichever arm runs, so racing costs no extra step. The model's tuner
(``_wrapper/tune.py``) rotates the arms, counts the replays and decides, with the same
statistics and confirmation round as for eager steps (``_wrapper/race.py``); a race of
eager steps underway is dropped first, and one graphed step per input shape races each
shape apart. Once decided, the model keeps the winner's hooks (for its eager forwards),
every call replays the winner's graph, and the other graphs are freed. Other tuning
models in the step are held plain until then (one model is raced at a time).

Each graph holds a memory pool of its own: while racing, the step's memory is held once
per arm captured (``tune_arms`` bounds how many; on one rank, an arm that leaves the race
frees its graph; under several, rank 0 decides, so every graph is kept until then). A
graph writes the gradients into buffers its capture allocated
(``zero_grad(set_to_none=True)``), so after each replay the raced model's ``.grad`` are
bound to the buffers of the arm replayed (after the deciding replay, to the winner's
from its next replay on). Parameters of modules the wrapper does not know (another
model the step trains) keep the ``.grad`` of the last arm captured while racing: read
their gradients inside the step.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from .._errors import OOOError
from .._events import EventKind, OOOEvent
from .._wrapper.arms import Arm
from .._wrapper.registry import graph_race_decided
from .._wrapper.tune import Tuner
from .._wrapper.tuning import Shape

__all__ = ["Capture", "Grads", "GraphRace", "Replayable", "bind_grads"]

logger = logging.getLogger("ooo_wrap")


class Replayable(Protocol):
    """A captured graph (``torch.cuda.CUDAGraph``)."""

    def replay(self) -> None: ...


# Capture the step once with the hooks now on the model (the arm held): its graph and the
# outputs the capture made. Each call warms the arm up eagerly first.
Capture = Callable[[], tuple[Replayable, Any]]


Grads = list[tuple[nn.Parameter, torch.Tensor | None]]


@dataclass
class _Captured:
    graph: Replayable
    outputs: Any
    grads: Grads


class GraphRace:
    """The arms of ``model``'s race (its ``tuner``), each captured by ``capture`` with its
    arm held; ``shape``: the static args' shapes (one graphed step per shape races each
    shape apart); ``others``: the tuners of other tuning models in the step, held plain
    until the race ends."""

    def __init__(
        self,
        model: nn.Module,
        tuner: Tuner,
        capture: Capture,
        shape: Shape,
        others: Sequence[Tuner] = (),
    ) -> None:
        self._model, self._tuner, self._capture, self._shape = model, tuner, capture, shape
        self._graphs: dict[str, _Captured] = {}
        self.replaying = ""  # the arm replayed last
        # Whatever ends the race (a decision, an error, the graphed step dropped
        # undecided) lets every held tuner go, so none stays held for good.
        self._let_go = weakref.finalize(self, _let_go, (tuner, *others))
        try:
            tuner.race_as_graphs()
            for arm in list(tuner.race.racing):
                self._add(arm)
            self._keep_captured_everywhere()
        except BaseException:
            self._let_go()
            raise

    def _add(self, arm: Arm) -> None:
        try:
            self._tuner.hold(arm)
            graph, outputs = self._capture()
        except Exception as error:
            if arm.is_plain:
                raise  # the step itself cannot be captured: graphed_step says why
            # An arm that cannot be captured (or does not fit in memory) leaves the race.
            self._leave(arm, f"could not be captured ({type(error).__name__}: {error})")
            return
        grads = [(p, p.grad) for p in self._model.parameters()]
        self._graphs[arm.name] = _Captured(graph, outputs, grads)

    def _keep_captured_everywhere(self) -> None:
        """Under several ranks, an arm captured on some ranks only leaves on all: rank 0's
        decision must be an arm every rank can replay."""
        arms = self._tuner.arms
        everywhere = self._tuner.shared.everywhere([arm.name in self._graphs for arm in arms])
        for arm, kept in zip(arms, everywhere, strict=True):
            if arm.name in self._graphs and not kept:
                del self._graphs[arm.name]
                self._leave(arm, "could not be captured on another rank")

    def _leave(self, arm: Arm, why: str) -> None:
        self._tuner.race.leave(arm)
        why = f"the {arm.name} arm {why} in a CUDA graph; it left the race"
        self._tuner.log.add(OOOEvent(EventKind.TUNED, "not_captured", why), level=logging.WARNING)

    @property
    def arms(self) -> tuple[str, ...]:
        """The arms captured, plain first."""
        return tuple(self._graphs)

    @property
    def decided(self) -> bool:
        """Whether the race is decided (by this graphed step's replays, or another's)."""
        return self._tuner.decision != "pending"

    def replay(self) -> tuple[Any, bool]:
        """Replay the graph of the arm whose turn it is, timed: its outputs, and whether
        the race is decided now."""
        tuner = self._tuner
        arm, counted = tuner.race.next_turn(self._shape)
        self.replaying = arm.name
        captured = self._graphs[arm.name]
        stream = tuner.backend.current_stream(tuner.device)
        start = tuner.clock.mark(stream)
        captured.graph.replay()
        end = tuner.clock.mark(stream)
        bind_grads(captured.grads)
        decided = tuner.replayed(arm if counted else None, self._shape, start, end)
        if tuner.shared.world == 1:  # else rank 0 decides, maybe for an arm that left here
            for name in set(self._graphs) - {arm.name for arm in tuner.race.racing}:
                del self._graphs[name]  # left the race: its memory pool goes
        return captured.outputs, decided

    def winner(self) -> tuple[Replayable, Any, Grads]:
        """The kept arm's graph, the outputs its replays rewrite and its gradient buffers;
        the other graphs are freed, and the model keeps the winner's hooks (or none)."""
        decision = self._tuner.decision
        kept = self._graphs.get(decision)
        if kept is None:
            raise OOOError(
                f"the race kept the {decision} arm, which this graphed step did not capture "
                "(a TUNED not_captured event says why); pin an arm with tune_arm=..."
            )
        self._graphs = {decision: kept}
        self._let_go()
        graph_race_decided(self._model, self._tuner)
        logger.info("ooo_wrap.graphed_step: the %s arm won as a graph", decision)
        return kept.graph, kept.outputs, kept.grads


def bind_grads(grads: Grads) -> None:
    """Bind each parameter's ``.grad`` to the buffer a graph's replays write."""
    for param, grad in grads:
        param.grad = grad


def _let_go(tuners: tuple[Tuner, ...]) -> None:
    for tuner in tuners:
        tuner.hold(None)
