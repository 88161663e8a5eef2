"""The root hooks: what a wrapped model's scheduler does once per forward.

The root pre-hook opens the forward's root call (``inflight.RootCall``), deciding once
for every stage call in it whether they run inline; the root post-hook closes it, makes
the caller's stream wait on every side stream the call used (step 5 of the protocol in
``scheduler.py``) and reports the stages the forward did not call. :class:`RootHooks`
holds what the scheduler keeps for a wrapped model; ``scheduler.Scheduler`` adds the
stage hooks, the hot path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from threading import get_ident
from typing import Any, NoReturn, SupportsIndex

import torch
from torch import nn
from torch.compiler import is_compiling

from .._errors import OOOError
from .._events import EventLog
from .._plan import Plan
from .._stats import Counters
from . import reports
from .accumulators import Accumulators
from .backend import Backend, Event, Stream
from .bypass import eager_bypass_reason
from .inflight import RootCall, StageRuntime, handled_exception, thread_state
from .stale import drop_stale_calls
from .wgrad import WeightGradSplit

__all__ = ["RootHooks"]


class RootHooks:
    """A wrapped model's scheduler state, with the hooks on its root module."""

    def __init__(
        self,
        plan: Plan,
        streams: Sequence[Stream],
        backend: Backend,
        events: EventLog,
        counters: Counters,
        device: torch.device | None = None,
    ) -> None:
        self._backend = backend
        # A plan with no stage (the weight-gradient split alone) names its device here.
        if plan.stages:
            device = plan.stages[0].device
        if device is None:
            raise ValueError("a plan with no stage needs its device")
        self._device: torch.device = device
        self._streams = tuple(streams)
        self._stages = tuple(
            StageRuntime(self, s, self._streams[s.stream], index)
            for index, s in enumerate(plan.stages)
        )
        self._events = events
        self._counters = counters
        self._unseen_reported: set[tuple[str, str]] = set()
        self._not_called_reported: set[str] = set()
        self._tied_weights = False  # some stages share a parameter; set by install()
        # The root's events of step 5, one per side stream, reused (as a stage's frame is)
        # by the thread whose root call first used a side stream.
        self._root_events: list[Event | None] = [None] * len(self._streams)
        self._root_thread: int | None = None
        # Set inside compiled code, where the log can't be written. A constant store: a
        # counter read and bumped there would be guarded on, and recompile every call.
        self.ran_compiled = False
        self._compiled_reported = False
        # Set by the wrapper: the accumulators to release when a forward runs on other
        # streams than the one before (accumulators.py), and the name of this plan's
        # layout of streams among those a model may run (measured tuning's arms).
        self.accumulators: Accumulators | None = None
        self.layout = "planned"
        # Set by the wrapper: the weight-gradient split of this plan's forwards (wgrad.py),
        # removed (the layers' classes restored) with these hooks.
        self.weight_grads: WeightGradSplit | None = None

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # Reached only when a stage module is copied or pickled apart from its wrapped
        # model (the wrapped model itself is copied without its hooks; _wrapper/serialize.py).
        raise OOOError(
            "a stage of a wrapped model was copied or pickled apart from the model (on its "
            "own, or through a reference outside the model's sub-modules, such as a plain "
            "list attribute), and its hooks belong to the wrapped model. Copy or pickle the "
            "whole wrapped model, save model.state_dict(), or ooo_wrap.unwrap(model) first"
        )

    def release(self) -> None:
        """Drop the reused frames and events of the stages and the root (its hooks are
        gone), so that nothing keeps the events or a call's objects; restore the split
        layers' classes."""
        if self.weight_grads is not None:
            self.weight_grads.remove()
            self.weight_grads = None
        self._root_events = [None] * len(self._streams)
        for stage in self._stages:
            stage.frame = None
            if stage.twin is not None:
                stage.twin.frame = None

    def sync_compiled_events(self) -> None:
        """Move bypass counts taken inside compiled code into the event log."""
        if self.ran_compiled and not self._compiled_reported:
            self._compiled_reported = True
            self._bypass_event("compiling")

    def stages_replay_in_a_graph(self) -> None:
        """Expect forwards that call no stage from now on, and say nothing of them.

        After ``torch.cuda.make_graphed_callables`` the model's forward replays a graph
        that ran its stages on their side streams when it was captured: the stage hooks
        no longer run, yet every stage runs where it should.
        """
        self._not_called_reported.update(stage.name for stage in self._stages)

    def stage_name_of(self, module: object) -> str | None:
        """The name of the stage whose hooks ``module`` carries, else ``None``."""
        for stage in self._stages:
            if stage.module is not None and stage.module() is module:
                return stage.name
        return None

    def _root_bypass(self) -> str | None:
        """Why every stage call of a forward starting now runs inline, or ``None``.

        Decided once for the whole call, at the root (cheaper than per stage call):
        ``disabled()``, tracing, and no_grad / inference_mode, which leave no backward to
        overlap. A stage's own no_grad inside a training forward (reentrant checkpoint
        runs its first forward so) still forks, as its recomputation will.
        """
        reason = eager_bypass_reason()
        if reason is None and not torch.is_grad_enabled():
            return "no_grad"
        return reason

    def _root_pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if is_compiling():
            # Nothing read here, one constant written: Dynamo replays the write after each
            # call and has nothing to guard on, so the model compiles once.
            self.ran_compiled = True
            return
        self._counters.forwards += 1
        local = thread_state
        if local.frames or local.calls:
            drop_stale_calls(module)
        call = RootCall(
            self,
            module,
            self._root_bypass(),
            local,
            len(self._stages),
            len(self._streams),
        )
        local.calls.append(call)
        accumulators = self.accumulators
        if accumulators is None:
            return
        if call.bypass != "no_grad":
            # Before any op of the forward: if it runs on other streams than the previous
            # one, the accumulators that one made are released, so each parameter's is
            # made where this forward first uses it.
            accumulators.begin(module, "inline" if call.bypass is not None else self.layout)
        else:
            accumulators.enter()  # no other thread may look up while this one runs

    def _root_post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if is_compiling():
            return
        local = thread_state
        calls = local.calls
        if not calls or calls[-1].module is not module:
            return  # our pre-hook did not run for this call (an earlier pre-hook raised)
        call = calls.pop()
        if self.accumulators is not None:
            self.accumulators.end(module)
        # Only after a forward that returned (and ran no stage inline) is a missing stage news.
        if not call.ran_inline and not all(call.called) and handled_exception() is None:
            self._report_not_called(module, call.called)
        used = call.used
        if True not in used:
            return
        backend = self._backend
        current = backend.current_stream(self._device)
        # Reused by the thread whose forward first used a side stream (see Frame); fresh
        # on any other.
        thread = get_ident()
        if self._root_thread is None:
            self._root_thread = thread
        events = self._root_events if self._root_thread == thread else [None] * len(self._streams)
        for index, stream in enumerate(self._streams):
            if used[index]:
                # 5. The caller's stream waits on all the call's stage streams.
                events[index] = event = backend.record_event(stream, events[index])
                backend.wait_event(current, event)
        self._counters.joins += used.count(True)

    # --- reports ---------------------------------------------------------------------

    def _report_not_called(self, root: nn.Module, called: list[bool]) -> None:
        """Say once per stage that a forward finished without calling it."""
        for stage in self._stages:
            if called[stage.index] or stage.name in self._not_called_reported:
                continue
            self._not_called_reported.add(stage.name)
            event = reports.not_called(root, stage, self.stage_name_of)
            self._events.add(event, level=logging.WARNING)

    def _bypass_event(self, reason: str, count: int = 1) -> None:
        self._events.add(reports.bypassed(reason, count), level=logging.INFO)
