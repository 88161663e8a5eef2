"""The ``dataflow`` planner inside the wrapper: learn the plan on the first training forward.

Until the plan is learned, a wrapped model carries only two hooks on its root (a
:class:`Learner`). The first eager forward with gradients on (not compiling, not capturing a
graph, not traced, not inside ``ooo_wrap.disabled()``) runs inline on the caller's stream
under an :class:`~ooo_wrap._planner.observe.Observer`; when it returns, the plan is learned from
what it saw, and the wrap state (``lifecycle.py``) replaces the two hooks with the
scheduler's (or with none at all when there is nothing to overlap). Correctness never
depends on the plan: any stages on any streams run the same per-stage-call protocol, so a
plan learned on one step stays correct on every later step, whatever the model does; it
only decides where overlap can happen. If observing or learning fails, the static plan is
used and an event says why.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from .._compat import dataflow_names_found
from .._events import EventKind, OOOEvent
from .._plan import Plan, StageSource, as_stage_names, plural
from .._planner.api import named_stages, reference_gpu
from .._planner.cost import ReferenceGPU
from .._planner.dataflow import learn
from .._planner.learned_plan import learned_of
from .._planner.observe import CallRecord, Observer
from .._planner.static import static_plan
from .._reasons import Reason
from .._runtime.accumulators import Accumulators
from .._runtime.backend import Backend
from .._runtime.bypass import eager_bypass_reason
from .._stats import Counters

__all__ = ["Learned", "Learner", "learned_events", "pending_plan", "removed_before_learning"]


class Learned(NamedTuple):
    """What a learner's hook returns once the plan is known."""

    plan: Plan
    failure: str | None  # why observing or learning failed (then it is the static plan)
    removed: tuple[str, ...] = ()  # named stages no longer in the model, left out


def pending_plan(streams: int) -> Plan:
    """The plan of a wrapped model whose plan is still to be learned."""
    return Plan(stages=(), max_streams=streams, source="dataflow")


def _learned(
    model: nn.Module, record: CallRecord, streams: int, named: Plan | None, gpu: ReferenceGPU
) -> Plan:
    names = None if named is None else [stage.name for stage in named.stages]
    source: StageSource = "dataflow" if named is None else named.source
    return learn(record, streams, gpu=gpu, stages=names).to_plan(model, source)


class Learner:
    """What the two root hooks of a model still to be learned do: observe the first eligible
    forward and return the plan learned from it (the wrap state registers the hooks and
    acts on what they return; a learner holds no hook and no reference to the model)."""

    def __init__(
        self,
        streams: int,
        stages: Sequence[str] | None,
        backend: Backend,
        device: torch.device,
        counters: Counters,
        accumulators: Accumulators,
        *,
        gpu: ReferenceGPU | None = None,
    ) -> None:
        self._counters = counters
        self._accumulators = accumulators
        self._gpu = gpu  # None: the default reference, read when learning
        self._streams = streams
        self._stages = stages
        self._backend = backend
        self._device = device
        self._observer: Observer | None = None
        self._depth = 0  # calls of the root inside the observed one (a root run recursively)
        # Set inside compiled code, where the log can't be written: a constant store, which
        # Dynamo has nothing to guard on; compiled_event() reports it once, outside.
        self.ran_compiled = False
        self._compiled_reported = False

    @property
    def observing(self) -> bool:
        """Whether a forward is being observed (its post-hook is still to run)."""
        return self._observer is not None

    def _eligible(self) -> bool:
        if not torch.is_grad_enabled() or eager_bypass_reason() is not None:
            return False  # no backward to learn for, or the user asked for inline
        backend = self._backend
        return not backend.is_capturing(backend.current_stream(self._device))

    def pre_hook(self, module: nn.Module) -> Learned | None:
        """The root pre-hook: start observing an eligible forward; the static plan if that fails."""
        if torch.compiler.is_compiling():
            self.ran_compiled = True
            return None  # nothing is learned under compile (and nothing read: no recompiles)
        if self._observer is not None:
            self._depth += 1
            return None
        self._counters.forwards += 1
        if not self._eligible():
            return None
        # This forward runs inline: its parameters' accumulators are made on the caller's
        # stream (and released again before the first planned forward).
        self._accumulators.begin(module, "inline")
        if not dataflow_names_found():
            return self._failed(module, "this torch lacks what observing a forward needs")
        observer = Observer(module, gpu=reference_gpu(self._gpu), inside_root=True)
        try:
            observer.__enter__()
        except Exception as error:
            return self._failed(
                module, f"observing the forward failed ({type(error).__name__}: {error})"
            )
        self._observer = observer
        return None

    def post_hook(self, module: nn.Module) -> Learned | None:
        """The root post-hook: the plan learned from the observed forward, once it returned."""
        if torch.compiler.is_compiling() or self._observer is None:
            return None
        if self._depth:
            self._depth -= 1
            return None
        observer, self._observer = self._observer, None
        raised = sys.exc_info()[1] is not None
        try:
            observer.__exit__(None, None, None)
            self._accumulators.end(module)
            if raised:
                return None  # the forward raised: learn on the next one
            stages, removed = _still_named(module, self._stages)
            if stages is not None and len(stages) < 2 and removed:
                return Learned(self._no_stages(), None, removed)
            named = named_stages(module, self._streams, stages)
            named = None if named is None else self._as_given(named)
            gpu = reference_gpu(self._gpu)
            plan = _learned(module, observer.record, self._streams, named, gpu)
            return Learned(plan, None, removed)
        except Exception as error:
            return self._failed(
                module, f"learning the plan failed ({type(error).__name__}: {error})"
            )

    def compiled_event(self) -> OOOEvent | None:
        """The event for forwards compiled before the plan was learned, once, if any ran."""
        if not self.ran_compiled or self._compiled_reported:
            return None
        self._compiled_reported = True
        return _compiled_before_learning()

    def _failed(self, module: nn.Module, why: str) -> Learned:
        """Fall back to the static plan (an event says why)."""
        stages, removed = _still_named(module, self._stages)
        if stages is not None and len(stages) < 2 and removed:
            return Learned(self._no_stages(), why, removed)
        return Learned(self._as_given(static_plan(module, self._streams, stages)), why, removed)

    def _source(self) -> StageSource:
        return "argument" if self._stages is not None else "attribute"

    def _as_given(self, named: Plan) -> Plan:
        """``named`` with the source the user's names came from (``ooo_stage_names`` read
        here, once one was left out, comes back as a list: an argument to the plan)."""
        if named.source == "automatic" or named.source == self._source():
            return named
        return dataclasses.replace(named, source=self._source())

    def _no_stages(self) -> Plan:
        """The plan when fewer than two named stages are left (the rest removed)."""
        return Plan(stages=(), max_streams=self._streams, source=self._source())


def _still_named(
    module: nn.Module, stages: Sequence[str] | None
) -> tuple[list[str] | None, tuple[str, ...]]:
    """The stage names the user gave (argument or ``ooo_stage_names``) that still name a
    sub-module, and those that do not (removed after wrapping: they were checked then).
    ``None`` and no names where the user named none or none was removed (the names are
    then read as at wrapping)."""
    given = stages if stages is not None else getattr(module, "ooo_stage_names", None)
    if given is None:
        return None, ()
    names = as_stage_names(given, "stages=" if stages is not None else "model.ooo_stage_names")
    known = {name for name, _ in module.named_modules(remove_duplicate=False)}
    removed = tuple(name for name in names if name not in known)
    if not removed:
        return (None if stages is None else list(stages)), ()
    return [name for name in names if name in known], removed


def removed_before_learning(name: str) -> OOOEvent:
    """The event for a named stage removed from the model before the plan was learned."""
    return OOOEvent(
        EventKind.STAGE_REPLACED,
        "removed",
        f"the model has no sub-module {name!r} any more (removed after wrapping): the plan "
        "leaves it out",
        stage=name,
    )


def _compiled_before_learning() -> OOOEvent:
    """The event for forwards compiled before the plan was learned (nothing is learned in
    compiled code, so the plan waits for an eager one)."""
    return OOOEvent(
        EventKind.BYPASSED,
        Reason.COMPILING,
        "ran under torch.compile before the plan was learned: stages run inline in the "
        "compiled graph (as they do under compile once there is a plan: the compiled path "
        "wins), and the plan stays to be learned, since only an eager forward is observed "
        "(compiled calls are not counted, so this event is recorded once); to learn it, run "
        "one eager training forward of the wrapped model before compiling (eager calls then "
        "use side streams), or pick one of torch.compile and ooo_wrap and benchmark it",
    )


def learned_events(the_plan: Plan) -> tuple[OOOEvent, ...]:
    """The ``PLANNED``/``learned`` event, then ``PLANNED``/``named_chain`` where the named
    stages form one chain."""
    learned = learned_of(the_plan)
    assert learned is not None  # only called for learned plans
    regions = plural(len(learned.regions), "parallel region")
    text = (
        f"learned from one forward: {plural(len(the_plan.stages), 'stage')} on "
        f"{plural(the_plan.num_streams, 'side stream')} in {regions}"
    )
    if learned.estimate is not None and the_plan.stages:
        text += f"; {learned.estimate}"
    events: tuple[OOOEvent, ...] = (OOOEvent(EventKind.PLANNED, "learned", text),)
    if learned.named_chain:  # none of them can overlap another: say so
        events += (OOOEvent(EventKind.PLANNED, "named_chain", learned.named_chain_message),)
    return events
