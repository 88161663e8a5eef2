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
import logging
import threading
from collections.abc import Sequence
from threading import get_ident
from typing import NamedTuple

import torch
from torch import nn

from .._compat import dataflow_names_found
from .._events import EventKind, EventLog, OOOEvent
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
from .._runtime.inflight import handled_exception
from .._stats import Counters

__all__ = [
    "Learned",
    "Learner",
    "learned_events",
    "learning_events",
    "pending_plan",
    "removed_before_learning",
]

logger = logging.getLogger("ooo_wrap")


class Learned(NamedTuple):
    """What a learner's hook returns once the plan is known."""

    plan: Plan
    failure: str | None  # why observing or learning failed (then it is the static plan)
    removed: tuple[str, ...] = ()  # named stages no longer in the model, left out


def pending_plan(streams: int) -> Plan:
    """The plan of a wrapped model whose plan is still to be learned."""
    return Plan(stages=(), max_streams=streams, source="dataflow")


def _learned(
    model: nn.Module,
    record: CallRecord,
    streams: int,
    named: Plan | None,
    gpu: ReferenceGPU,
    by_simulation: bool,
    graphed: bool,
) -> Plan:
    names = None if named is None else [stage.name for stage in named.stages]
    source: StageSource = "dataflow" if named is None else named.source
    learned = learn(
        record, streams, gpu=gpu, stages=names, by_simulation=by_simulation, graphed=graphed
    )
    return learned.to_plan(model, source)


class Learner:
    """What the two root hooks of a model still to be learned do: observe the first eligible
    forward and return the plan learned from it (the wrap state registers the hooks and
    acts on what they return; a learner holds no hook and no reference to the model).

    One forward is observed at a time, on one thread: forwards of other threads meanwhile
    run plain (inline, unobserved), and once a plan is learned no other thread starts
    learning. A forward that a ``BaseException`` (``KeyboardInterrupt``) ended skips the
    post-hook: the observer stops recording at the next op or module call of its thread,
    and is closed (its dispatch mode left) by the next forward of the model on that thread
    (which learns), by :meth:`close` (``replan()``, ``unwrap()``) on that thread, or by
    another thread's forward once that thread has ended.
    """

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
        log: EventLog | None = None,
        by_simulation: bool = True,
        graphed: bool = False,
    ) -> None:
        # Keep only regions the estimate says pay (False: every region the rule finds).
        self._by_simulation = by_simulation
        # How the plan is priced: as a CUDA graph replay of the step, or eager launches.
        # Set before the observed forward (``registry.price_as_graph_replay``).
        self.graphed = graphed
        self._counters = counters
        self._accumulators = accumulators
        self._gpu = gpu  # None: the default reference, read when learning
        self._streams = streams
        self._stages = stages
        self._backend = backend
        self._device = device
        self._log = log
        self._lock = threading.Lock()  # who observes: claimed and given back under it
        self._observer: Observer | None = None  # the forward observed, on its thread
        self._depth = 0  # calls of the root inside the observed one (a root run recursively)
        # Set inside compiled code, where the log can't be written: a constant store, which
        # Dynamo has nothing to guard on; compiled_event() reports it once, outside.
        self.ran_compiled = False
        self._compiled_reported = False
        self._outer_exception: BaseException | None = None  # handled as the observed began
        self._initializing: int | None = None  # the thread whose forward initializes lazy params
        self._done = False  # a plan was returned: nothing more to observe
        self._waited = False  # a forward initialized lazy parameters (once is enough)

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
        # Before any op: while another thread looks accumulators up (which swaps
        # ``param.data`` for a moment), wait, and have it never do so again.
        self._accumulators.enter()
        observer = self._observer
        if observer is not None:
            if observer.interrupted:
                self._close_interrupted(module, observer)
            elif observer.thread == get_ident():
                self._depth += 1  # called inside the observed forward
                return None
        self._counters.forwards += 1
        if self._observer is not None or self._done or not self._eligible():
            return None  # another thread observes (this forward runs plain), or no training
        if not self._waited and _uninitialized(module):
            self._initialize_first(module)
            return None
        with self._lock:
            if self._observer is not None or self._done:
                return None  # another thread claimed it meanwhile
            observer = Observer(module, gpu=reference_gpu(self._gpu), inside_root=True)
            self._observer, self._depth = observer, 0
            self._outer_exception = handled_exception()
        # This forward runs inline: its parameters' accumulators are made on the caller's
        # stream (and released again before the first planned forward).
        self._accumulators.begin(module, "inline")
        if not dataflow_names_found():
            self._give_back(observer, done=True)
            return self._failed(module, "this torch lacks what observing a forward needs")
        try:
            observer.__enter__()
        except Exception as error:
            self._give_back(observer, done=True)
            observer.__exit__(None, None, None)  # what it had put on comes off
            return self._failed(
                module, f"observing the forward failed ({type(error).__name__}: {error})"
            )
        return None

    def post_hook(self, module: nn.Module) -> Learned | None:
        """The root post-hook: the plan learned from the observed forward, once it returned."""
        if torch.compiler.is_compiling():
            return None
        if self._initializing == get_ident():
            self._initializing = None
            self._accumulators.end(module)
            return None
        observer = self._observer
        if observer is None or observer.thread != get_ident():
            return None  # a forward that was not observed (another thread's is)
        if self._depth:
            self._depth -= 1
            return None
        # A forward called while an exception is handled (a retry in an ``except`` block)
        # raised only if another exception is handled now.
        raised = handled_exception() is not self._outer_exception
        if not self._give_back(observer, done=not raised):
            return None
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
            judge, graphed = self._by_simulation, self.graphed
            plan = _learned(module, observer.record, self._streams, named, gpu, judge, graphed)
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

    def close(self) -> None:
        """Stop observing (the learner's hooks come off): on the observed thread the
        observer's dispatch mode is left too; elsewhere it records nothing more."""
        with self._lock:
            observer, self._observer, self._done = self._observer, None, True
        if observer is not None:
            observer.__exit__(None, None, None)

    def _give_back(self, observer: Observer, *, done: bool) -> bool:
        """Let go of ``observer``; whether it was still the one observing."""
        with self._lock:
            if self._observer is not observer:
                return False  # another thread gave it back already
            self._observer = None
            self._done = self._done or done
            self._outer_exception = None  # the handled exception must not be kept alive
            return True

    def _close_interrupted(self, module: nn.Module, observer: Observer) -> None:
        """Close what an interrupted observed forward left (its post-hook never ran)."""
        if not self._give_back(observer, done=False):
            return
        self._depth = 0
        observer.__exit__(None, None, None)
        self._accumulators.end(module)
        logger.info("the observed forward was interrupted; the next training forward learns")

    def _initialize_first(self, module: nn.Module) -> None:
        """The first training forward that starts with lazy parameters (``nn.LazyLinear``)
        not initialized yet runs unobserved: its ops would be the parameters' initialization
        as much as the model's, and the learned plan is the steady state's. It is an inline
        forward for the accumulators, and the next training forward learns (even if a lazy
        module it did not call is still to be initialized: the observer counts its
        parameters once they are)."""
        with self._lock:
            if self._initializing is not None or self._observer is not None:
                return
            self._initializing, self._waited = get_ident(), True
        self._accumulators.begin(module, "inline")
        if self._log is not None:
            self._log.add(
                OOOEvent(
                    EventKind.PLANNED,
                    "lazy_parameters",
                    "the model has parameters that are not initialized yet (lazy modules): "
                    "the plan is learned from the first training forward after they are",
                ),
                level=logging.INFO,
            )

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


def _uninitialized(module: nn.Module) -> bool:
    """Whether ``module`` has a lazy parameter or buffer not initialized yet."""
    lazy = (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)
    return any(isinstance(t, lazy) for t in (*module.parameters(), *module.buffers()))


def learning_events(
    the_plan: Plan, failure: str | None, removed: Sequence[str]
) -> list[tuple[OOOEvent, int]]:
    """The events (and log levels) of a plan just learned: named stages left out, a
    fallback to the static plan, or what the planner found."""
    events = [(removed_before_learning(name), logging.WARNING) for name in removed]
    if failure is not None:
        fallback = OOOEvent(
            EventKind.PLANNED,
            "static_fallback",
            f"{failure}; using the static plan (stage names or automatic expansion, streams "
            "round-robin)",
        )
        events.append((fallback, logging.WARNING))
    elif learned_of(the_plan) is not None:
        events += [(event, logging.INFO) for event in learned_events(the_plan)]
    return events
