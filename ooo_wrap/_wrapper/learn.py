"""The ``dataflow`` planner inside the wrapper: learn the plan on the first training forward.

Until the plan is learned, a wrapped model carries only two hooks on its root (a
:class:`Learner`). The first eager forward with gradients on (not compiling, not capturing a
graph, not traced, not inside ``ooo_wrap.disabled()``) runs inline on the caller's stream
under an :class:`~ooo_wrap._planner.observe.Observer`; when it returns, the plan is learned from
what it saw and :func:`finish` replaces the two hooks with the scheduler's (or with none at
all when there is nothing to overlap). Correctness never depends on the plan: any stages
on any streams run the same per-stage-call protocol, so a plan learned on one step stays
correct on every later step, whatever the model does; it only decides where overlap can
happen. If observing or learning fails, the static plan is used and an event says why.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._events import EventKind, OOOEvent
from .._plan import Plan, StageSource, plural
from .._planner.api import named_stages, reference_gpu
from .._planner.cost import ReferenceGPU
from .._planner.dataflow import learn
from .._planner.learned_plan import learned_of
from .._planner.observe import CallRecord, Observer
from .._planner.static import static_plan
from .._runtime.accumulators import Accumulators
from .._runtime.backend import Backend
from .._runtime.bypass import eager_bypass_reason
from .._stats import Counters
from .handles import remove_part

if TYPE_CHECKING:
    from .module import _WrapState

__all__ = ["Learner", "finish", "pending_plan"]

logger = logging.getLogger("ooo_wrap")


def pending_plan(streams: int) -> Plan:
    """The plan of a wrapped model whose plan is still to be learned."""
    return Plan(stages=(), max_streams=streams, source="dataflow")


def _learned(
    model: nn.Module, record: CallRecord, streams: int, named: Plan | None, gpu: ReferenceGPU
) -> Plan:
    names = None if named is None else [stage.name for stage in named.stages]
    source: StageSource = "dataflow" if named is None else named.source
    return learn(record, streams, gpu=gpu, stages=names).to_plan(model, source)


Finish = Callable[[nn.Module, Plan, str | None], None]


class Learner:
    """Two root hooks that observe the first eligible forward and then call ``finish``."""

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
        self.handles: list[RemovableHandle] = []
        self.finish: Finish | None = None  # set by the wrapper: what to do with the plan

    def install(self, model: nn.Module, handles: list[RemovableHandle]) -> None:
        """Register the two hooks, appending each handle to ``handles`` as soon as it exists."""
        pre = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True, prepend=True)
        handles.append(pre)
        self.handles.append(pre)
        post = model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True)
        handles.append(post)
        self.handles.append(post)

    @property
    def observing(self) -> bool:
        """Whether a forward is being observed (its post-hook is still to run)."""
        return self._observer is not None

    def remove(self, handles: list[RemovableHandle]) -> None:
        """Remove the two hooks, and their handles from ``handles``."""
        remove_part(self.handles, handles)

    def _eligible(self) -> bool:
        if not torch.is_grad_enabled() or eager_bypass_reason() is not None:
            return False  # no backward to learn for, or the user asked for inline
        backend = self._backend
        return not backend.is_capturing(backend.current_stream(self._device))

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return  # nothing is learned under compile (and nothing read: no recompiles)
        if self._observer is not None:
            self._depth += 1
            return
        self._counters.forwards += 1
        if not self._eligible():
            return
        # This forward runs inline: its parameters' accumulators are made on the caller's
        # stream (and released again before the first planned forward).
        self._accumulators.begin(module, "inline")
        observer = Observer(module, gpu=reference_gpu(self._gpu), inside_root=True)
        try:
            observer.__enter__()
        except Exception as error:
            self._fail(module, f"observing the forward failed ({type(error).__name__}: {error})")
            return
        self._observer = observer

    def _post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or self._observer is None:
            return
        if self._depth:
            self._depth -= 1
            return
        observer, self._observer = self._observer, None
        raised = sys.exc_info()[1] is not None
        try:
            observer.__exit__(None, None, None)
            self._accumulators.end(module)
            if raised:
                return  # the forward raised: learn on the next one
            named = named_stages(module, self._streams, self._stages)
            gpu = reference_gpu(self._gpu)
            learned = _learned(module, observer.record, self._streams, named, gpu)
        except Exception as error:
            self._fail(module, f"learning the plan failed ({type(error).__name__}: {error})")
            return
        if self.finish is not None:
            self.finish(module, learned, None)

    def _fail(self, module: nn.Module, why: str) -> None:
        """Fall back to the static plan (an event says why)."""
        if self.finish is not None:
            self.finish(module, static_plan(module, self._streams, self._stages), why)


def finish(
    model: nn.Module,
    state: _WrapState,
    the_plan: Plan,
    failure: str | None,
    start: Callable[[nn.Module, _WrapState, Plan], None],
) -> None:
    """Replace the learner's hooks with the scheduler's for ``the_plan``, or with none.

    ``start`` creates the streams and installs the scheduler (``_wrap.start_scheduler``);
    if it fails, its hooks are removed and the model runs inline, with an event saying so.
    """
    if state.learner is not None:
        state.learner.remove(state.handles)
        state.learner = None
    state.plan = the_plan
    log = state.log
    learned = learned_of(the_plan)
    if failure is not None:
        log.add(
            OOOEvent(
                EventKind.PLANNED,
                "static_fallback",
                f"{failure}; using the static plan (stage names or automatic expansion, "
                "streams round-robin)",
            ),
            level=logging.WARNING,
        )
    elif learned is not None:
        log.add(OOOEvent(EventKind.PLANNED, "learned", _summary(the_plan)), level=logging.INFO)
    if learned is not None and learned.outcome == "no_parallelism":
        state.stop("no_parallelism", learned.no_parallelism_message)
        return
    if not the_plan.stages or (failure is not None and len(the_plan.stages) < 2):
        state.stop("too_few_stages", "fewer than two stages: nothing to overlap")
        return
    if len(the_plan.devices) > 1:
        state.stop("multi_device", "stages span several devices")
        return
    reason = state.backend.unsupported_reason(the_plan.devices[0])
    if reason is not None:
        state.stop(reason, f"the stages' device {the_plan.devices[0]} has no side streams")
        return
    try:
        start(model, state, the_plan)
    except Exception as error:
        state.stop("setup_failed", f"setup failed ({type(error).__name__}: {error})")


def _summary(the_plan: Plan) -> str:
    learned = learned_of(the_plan)
    assert learned is not None  # only called for learned plans
    regions = plural(len(learned.regions), "parallel region")
    text = (
        f"learned from one forward: {plural(len(the_plan.stages), 'stage')} on "
        f"{plural(the_plan.num_streams, 'side stream')} in {regions}"
    )
    if learned.estimate is not None and the_plan.stages:
        text += f"; {learned.estimate}"
    return text
