"""The per-stage-call protocol: fork onto a side stream in the pre-hook, join in the post-hook.

For one stage call, with ``ambient`` the caller's current stream and ``s`` the stage's:

1. ``s`` waits on an event recorded on ``ambient`` now, which orders every earlier
   producer of the inputs (earlier stages were already joined into ``ambient``).
2. Each input tensor gets ``record_stream(s)``: autograd may save it and read it on ``s``
   in backward, so the allocator must not hand its block to ``ambient`` meanwhile.
   This is done before step 1's event is recorded (and outputs' ``record_stream`` before
   step 4's event): older CUDA Stream Sanitizers count ``record_stream`` as a write on
   the current stream, and the event must cover it.
3. ``s`` becomes current and the stage runs; autograd records ``s`` on its nodes, so
   the engine runs their backward on ``s`` too.
4. Post-hook, always (even if the stage raised): each output gets
   ``record_stream(ambient)``, since it was allocated on ``s`` and the caller reads it on
   ``ambient``; an event ``e`` is recorded on ``s``; ``ambient`` is restored and waits on
   ``e``, so no untracked parent op can read an unfinished stage.
5. Root post-hook: the current stream waits on every stage stream used in the call,
   before the output (and the loss) reaches the host.

Under CUDA graph capture on the caller's stream the same steps are what the capture
needs, so nothing changes: step 1's event, recorded on the capturing stream and waited
on by ``s``, pulls ``s`` into the capture; step 4's wait brings it back, and step 5 makes
every side stream used rejoin before the caller can end the capture. The events are
re-recorded on every call, so no wait ever crosses the capture's boundary.

With ``overlap_forward`` the wait of step 4 is left pending until something touches the
stage's results, and step 1 also waits on the pending joins of the stages whose outputs
the call receives (``deferred.py``); the hooks are then wrapped so that their own reads
of the tensors do not count as touches.

``_profiling.ProfiledScheduler`` adds profiler ranges around steps 3-4 by overriding the
two stage hooks, so a model wrapped without ``profile_ranges`` pays nothing for them.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn, SupportsIndex

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._compat import is_checkpoint_early_stop, storage_tensor
from .._errors import OOOError
from .._events import EventKind, EventLog, OOOEvent
from .._plan import Plan
from .._stats import Counters
from .._tensors import tensors_in
from . import deferred as _deferred
from .accumulators import Accumulators
from .backend import Backend, Stream
from .bypass import BYPASS_MESSAGES, eager_bypass_reason
from .inflight import (
    NO_EVENTS,
    Frame,
    RootCall,
    RootEvents,
    StageRuntime,
    pair_tied_stages,
    stage_depth,
    thread_state,
)

__all__ = ["Scheduler", "running"]


class Scheduler:
    """Hooks that run each stage of one wrapped model on its side stream."""

    def __init__(
        self,
        plan: Plan,
        streams: Sequence[Stream],
        backend: Backend,
        events: EventLog,
        counters: Counters,
        overlap_forward: bool = False,
    ) -> None:
        self._backend = backend
        # Joins deferred until first touch (deferred.py); read on the hot path only where
        # a plain join would happen, so a model without it pays one attribute test there.
        self.overlap_forward = overlap_forward
        self._device = plan.stages[0].device
        self._streams = tuple(streams)
        self._stages = tuple(StageRuntime(self, s, self._streams[s.stream]) for s in plan.stages)
        self._events = events
        self._counters = counters
        self._local = thread_state
        self._root_events = RootEvents(len(self._streams))
        self._unseen_reported: set[tuple[str, str]] = set()
        self._not_called_reported: set[str] = set()
        self._tied_weights = False  # some stages share a parameter; set by install()
        # Set inside compiled code, where the log can't be written. A constant store: a
        # counter read and bumped there would be guarded on, and recompile every call.
        self.ran_compiled = False
        self._compiled_reported = False
        # Why stage calls outside any root call run inline, if they must: set by measured
        # tuning during a plain step, whose backward may recompute checkpointed stages.
        self.bypass_outside_forward: str | None = None
        # Set by the wrapper: the accumulators to release when a forward runs on other
        # streams than the one before (accumulators.py); while a tuner runs, its root
        # pre-hook (run before any op of the forward, after this one) does it instead,
        # once it has chosen the arm.
        self.accumulators: Accumulators | None = None
        self.layout_by_tuner = False

    def install(self, model: nn.Module, handles: list[RemovableHandle]) -> None:
        """Register the hooks, appending each handle to ``handles`` as soon as it exists."""
        handles.append(
            model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True, prepend=True)
        )
        handles.append(
            model.register_forward_hook(self._root_post_hook, with_kwargs=True, always_call=True)
        )
        self._tied_weights = pair_tied_stages(model, self._stages)
        deferring = self.overlap_forward
        for stage in self._stages:
            module = model.get_submodule(stage.name)
            stage.module = weakref.ref(module)
            pre_hook = self._deferring_pre_hook if deferring else self._stage_pre_hook
            pre = functools.partial(pre_hook, stage)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            post_hook = self._deferring_post_hook if deferring else self._stage_post_hook
            post = functools.partial(post_hook, stage)
            handles.append(module.register_forward_hook(post, with_kwargs=True, always_call=True))

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
        """Forget this thread's reused events of the stages (its hooks are gone): they
        would keep the scheduler, its streams and its log alive for as long as the thread."""
        events = self._local.events
        for stage in self._stages:
            events.pop(stage, None)
            if stage.twin is not None:
                events.pop(stage.twin, None)

    def sync_compiled_events(self) -> None:
        """Move bypass counts taken inside compiled code into the event log."""
        if self.ran_compiled and not self._compiled_reported:
            self._compiled_reported = True
            self._bypass_event("compiling")

    # --- hooks ----------------------------------------------------------------------

    def _root_pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            # Nothing read here, one constant written: Dynamo replays the write after each
            # call and has nothing to guard on, so the model compiles once.
            self.ran_compiled = True
            return
        self._counters.forwards += 1
        local = self._local
        if local.frames or local.calls:
            _drop_stale_calls(module)
        call = RootCall(self, module)
        local.calls.append(call)
        accumulators = self.accumulators
        if accumulators is not None and call.bypass != "no_grad" and not self.layout_by_tuner:
            # Before any op of the forward: if it runs on other streams than the previous
            # one, the accumulators that one made are released, so each parameter's is
            # made where this forward first uses it.
            accumulators.begin(module, "inline" if call.bypass is not None else "planned")

    def _root_post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        calls = self._local.calls
        if not calls or calls[-1].module is not module:
            return  # our pre-hook did not run for this call (an earlier pre-hook raised)
        call = calls.pop()
        if self.accumulators is not None:
            self.accumulators.end(module)
        if self.overlap_forward:
            # 5. (deferred) The waits below cover every join this call left pending.
            _deferred.suspend()
            _deferred.finish(call.first_pending, self)
            _deferred.resume(len(self._local.frames), stage_depth)
        # Only after a forward that returned (and ran no stage inline) is a missing stage news.
        if (
            len(call.called) < len(self._stages)
            and not call.ran_inline
            and sys.exc_info()[1] is None
        ):
            self._report_not_called(module, call.called)
        used = call.used
        if not used:
            return
        backend = self._backend
        current = backend.current_stream(self._device)
        events = self._root_events.events
        for index in sorted(used):
            # 5. The caller's stream waits on all the call's stage streams.
            events[index] = event = backend.record_event(self._streams[index], events[index])
            backend.wait_event(current, event)
        self._counters.joins += len(used)

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

    def _report_not_called(self, root: nn.Module, called: set[StageRuntime]) -> None:
        """Say once per stage that a forward finished without calling it: its hooks never
        ran, so it never ran on its stream (a grouping module forward does not call, a
        branch this forward did not take, or a stage replaced after wrapping)."""
        for stage in self._stages:
            if stage in called or stage.name in self._not_called_reported:
                continue
            self._not_called_reported.add(stage.name)
            event = self._surgery_event(root, stage) or OOOEvent(
                EventKind.STAGE_NOT_CALLED,
                "not_called",
                "a forward of the model finished without calling this stage, so it did "
                "not run on its side stream; if forward never calls it as a module (it "
                "only groups others), name the sub-modules forward calls with "
                "stages=[...]",
                stage=stage.name,
            )
            self._events.add(event, level=logging.WARNING)

    def _surgery_event(self, root: nn.Module, stage: StageRuntime) -> OOOEvent | None:
        """The event for a stage that is no longer the module at its name (model surgery
        after wrapping: ``model.blocks[1] = new``, ``del model.blocks[2]``), else ``None``.

        Looked up only here, off the hot path: the hooks stay on the module wrapped as the
        stage, so whatever now sits at the name runs as forward calls it, hook-free.
        """
        try:
            current: nn.Module | None = root.get_submodule(stage.name)
        except AttributeError:
            current = None
        wrapped = stage.module() if stage.module is not None else None
        if current is not None and current is wrapped:
            return None
        fix = (
            "model.replan() (dataflow planner) or ooo_wrap.unwrap(model) and wrapping it "
            "again plans with the model as it is now"
        )
        if current is None:
            return OOOEvent(
                EventKind.STAGE_REPLACED,
                "removed",
                f"the model has no sub-module {stage.name!r} any more (removed after "
                f"wrapping), so this stage no longer runs; {fix}",
                stage=stage.name,
            )
        other = self.stage_name_of(current)
        now = (
            f"the module now there runs as stage {other!r}, on that stage's side stream"
            if other is not None
            else "the module now there is not a stage: it runs inline on the caller's "
            "stream, as a plain sub-module"
        )
        return OOOEvent(
            EventKind.STAGE_REPLACED,
            "replaced",
            f"sub-module {stage.name!r} was replaced after wrapping; {now}; {fix}",
            stage=stage.name,
        )

    def _stage_pre_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any
    ) -> None:
        if torch.compiler.is_compiling():
            return  # inline in the compiled graph; the root pre-hook noted it
        local = self._local
        frames = local.frames
        calls = local.calls
        if calls:
            call = calls[-1]
            if call.owner is not self:
                return  # another wrapped model's call reached a module we share with it
            reason = call.bypass
        elif frames and frames[-1].module is module and frames[-1].stage.owner is not self:
            return  # outside any forward, a model sharing this module already forked
        else:  # outside any root call: a checkpoint recomputing it in backward, a direct call
            reason = eager_bypass_reason() or self.bypass_outside_forward
        backend = self._backend
        if local.recomputing is not None:
            # A checkpoint recomputing in backward, forked or inline: what this call saves
            # is ordered for each node that reads it as the unpack hook returns, on
            # whatever stream that node runs (recompute.py).
            local.recomputing.append((backend, stage.device))
        if reason is not None:
            if _deferred.pending_count():
                # It runs on the caller's stream, one level down where no touch is seen:
                # join first what is pending there (this model's, or another's with
                # overlap_forward whose forward calls this model).
                _deferred.join_pending(len(frames), stage_depth)
            self._counters.bypasses += 1
            self._bypass_event(reason)
            frames.append(Frame(stage, module, None, NO_EVENTS))
            if calls:
                call.ran_inline = True
            return
        if calls:
            call.called.add(stage)
        if (
            self._tied_weights
            and stage.twin is not None
            and torch.is_autocast_enabled(stage.device_type)
        ):
            stage = stage.twin  # share the stream whose cached weight copy it will read
        stream = stage.stream
        ambient = backend.current_stream(stage.device)
        # 2. Inputs: s may read them in backward; keep their blocks from ambient's reuse.
        # Before the fork event: older CUDA Stream Sanitizers count record_stream as a
        # write on the current stream, which the event must then cover.
        # 2b. Kept under graph capture (and needed there). PyTorch's caching allocator
        # (c10/cuda/CUDACachingAllocator.cpp, as read at pytorch/pytorch 001074d):
        # free() of a block with stream uses while any capture is underway pushes it on
        # needs_events_deferred_until_no_capture instead of freeing it; only
        # insert_events_deferred_until_no_capture(), called from process_events() and
        # synchronize_and_free_events() once no capture is underway, inserts its events
        # (less the streams recorded during the capture, which must have rejoined) and
        # frees it. So the block is never reused inside the capture. Without
        # record_stream it would be, on ambient while s still reads it: a graph is a
        # fixed schedule, so that race would happen in every replay. The cost: such
        # blocks stay held in the graph's private pool until the capture ends instead of
        # being reused within it.
        unseen = local.unseen
        inputs = tensors_in(args, unseen)
        if kwargs:
            inputs += tensors_in(kwargs, unseen)
        blind = bool(unseen)  # some input tensors may be missing from ``inputs``
        if blind:
            self._report_unseen(stage, unseen)
        recorded = _record_stream(backend, inputs, stage.device, stream)
        # 1. s waits on everything queued on ambient so far.
        events = local.events.get(stage)
        if events is None:
            events = local.events[stage] = [None, None]
        events[0] = fork = backend.record_event(ambient, events[0])
        backend.wait_event(stream, fork)
        if self.overlap_forward:
            # 1b. ...and on the pending join of each stage whose output it receives.
            self._counters.waits += _deferred.wait_for_inputs(stream, backend, inputs, blind)
        # 3. Switch last, so a failure above leaves the caller's stream untouched.
        backend.set_stream(stream)
        frame = Frame(stage, module, ambient, events)
        if self.overlap_forward:
            frame.inputs = (inputs, _deferred.versions(inputs))
            frame.blind = blind
        frames.append(frame)
        if calls:
            call.used.add(stage.stream_index)
        counters = self._counters
        counters.stage_calls += 1
        counters.waits += 1
        counters.record_streams += recorded

    def _stage_post_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        if torch.compiler.is_compiling():
            return
        local = self._local
        frames = local.frames
        if not frames or (frames[-1].stage is not stage and frames[-1].stage is not stage.twin):
            return  # our pre-hook did not run for this call (an earlier pre-hook raised)
        frame = frames.pop()
        stage = frame.stage  # its twin, if it ran on a tied stage's stream
        ambient = frame.ambient
        if ambient is not None:
            backend = self._backend
            stream = stage.stream
            recorded = 0
            try:
                # 4. Outputs are read on ambient from now on; e then marks all the stage's
                # work, record_stream included (see step 2 for why that order).
                unseen = local.unseen
                outputs = tensors_in(output, unseen)
                blind = bool(unseen)
                if blind:
                    self._report_unseen(stage, unseen)
                recorded = _record_stream(backend, outputs, stage.device, ambient)
                events = frame.events
                events[1] = event = backend.record_event(stream, events[1])
            finally:
                backend.set_stream(ambient)
            # With overlap_forward the wait is left pending when nothing failed and a root
            # call will join it (deferred.py); the outputs' record_stream above holds.
            if not (
                self.overlap_forward
                and local.calls
                and local.recomputing is None  # a recomputation's end event must follow it
                and sys.exc_info()[1] is frame.outer_exception
                and _deferred.defer(
                    len(frames),
                    ambient,
                    event,
                    backend,
                    self._counters,
                    self,
                    stage.device,
                    outputs + _deferred.written(*frame.inputs),
                    blind or frame.blind,
                )
            ):
                backend.wait_event(ambient, event)
                self._counters.joins += 1
            self._counters.record_streams += recorded
        error = sys.exc_info()[1]
        # A checkpoint that stops recomputing early raises through the stage on purpose.
        if (
            error is not None
            and error is not frame.outer_exception
            and not is_checkpoint_early_stop(error)
        ):
            self._counters.failures += 1
            self._events.add(
                OOOEvent(
                    EventKind.STAGE_FAILED,
                    type(error).__name__,
                    f"stage raised {type(error).__name__}; the caller's stream was restored "
                    "and the exception propagated unchanged",
                    stage=stage.name,
                ),
                level=logging.INFO,
            )

    def _deferring_pre_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any
    ) -> None:
        if torch.compiler.is_compiling():
            return  # inline in the compiled graph, nothing deferred
        _deferred.suspend()  # the hook's own reads of the inputs must not join
        try:
            self._stage_pre_hook(stage, module, args, kwargs)
        finally:
            _deferred.resume(len(self._local.frames), stage_depth)

    def _deferring_post_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        if torch.compiler.is_compiling():
            return  # inline in the compiled graph, nothing deferred
        _deferred.suspend()
        try:
            self._stage_post_hook(stage, module, args, kwargs, output)
        finally:
            _deferred.resume(len(self._local.frames), stage_depth)

    def _report_unseen(self, stage: StageRuntime, unseen: list[str]) -> None:
        """Record once per (stage, type) an input or output the hooks could not search."""
        for name in unseen:
            if (stage.name, name) not in self._unseen_reported:
                self._unseen_reported.add((stage.name, name))
                self._events.add(
                    OOOEvent(
                        EventKind.UNTRACKED,
                        name,
                        f"an input or output of this stage holds a {name} the hooks cannot "
                        "search for tensors (no attributes, or an object inside an object): "
                        "tensors in it get no record_stream, an allocator hazard on a GPU. "
                        "Pass tensors in tuples, lists, dicts, dataclasses, objects' own "
                        "attributes, or types registered with torch.utils._pytree",
                        stage=stage.name,
                    ),
                    level=logging.WARNING,
                )
        unseen.clear()

    def _bypass_event(self, reason: str, count: int = 1) -> None:
        self._events.add(
            OOOEvent(EventKind.BYPASSED, reason, BYPASS_MESSAGES[reason], count=count),
            level=logging.INFO,
        )


def _drop_stale_calls(root: nn.Module | None) -> None:
    """Undo what interrupted forwards left behind on this thread, as ``root`` starts (or
    as ``replan()`` or ``unwrap()`` is called, with no root).

    ``always_call`` post-hooks run for an ``Exception`` but not for a bare
    ``BaseException`` such as ``KeyboardInterrupt``, so a stage interrupted that way
    leaves its stream current and its frame in flight. A call still in flight is one whose
    module is still being called on the Python stack (the root may legitimately run inside
    one of its own stages); only the rest are stale. Walking the stack costs tens of
    microseconds, paid only when a root starts with something in flight.
    """
    executing = _executing()
    if root is not None:
        executing[id(root)] -= 1  # the call starting now
    local = thread_state
    stale_calls = _stale_suffix(local.calls, executing.copy())
    stale_frames = _stale_suffix(local.frames, executing)
    if not stale_calls and not stale_frames:
        return
    outermost = next((f for f in stale_frames if f.ambient is not None), None)
    owners = {id(c.owner): c.owner for c in stale_calls}
    owners.update((id(f.stage.owner), f.stage.owner) for f in stale_frames)
    del local.calls[len(local.calls) - len(stale_calls) :]
    del local.frames[len(local.frames) - len(stale_frames) :]
    if outermost is not None:
        outermost.stage.owner._backend.set_stream(outermost.ambient)
    _deferred.join_pending(len(local.frames), stage_depth)  # what they left pending
    for owner in owners.values():
        owner._events.add(
            OOOEvent(
                EventKind.STAGE_FAILED,
                "interrupted",
                "an earlier forward was interrupted inside a stage (e.g. KeyboardInterrupt); "
                "the caller's stream was restored when the model was next called, "
                "replanned or unwrapped",
            ),
            level=logging.INFO,
        )


def _executing() -> collections.Counter[int]:
    """How many calls of each module (by id) are running on this thread's Python stack."""
    executing: collections.Counter[int] = collections.Counter()
    call_impl = nn.Module._call_impl.__code__
    frame = inspect.currentframe()
    while frame is not None:
        if frame.f_code is call_impl:
            executing[id(frame.f_locals.get("self"))] += 1
        frame = frame.f_back
    return executing


def running(root: nn.Module, scheduler: Scheduler | None, observed: bool = False) -> bool:
    """Whether a call of ``root`` (observed by the dataflow planner when ``observed``), or
    of one of ``scheduler``'s stages, is running on this thread. What interrupted
    forwards left in flight is undone first: those calls are over."""
    local = thread_state
    if local.calls or local.frames:
        _drop_stale_calls(None)
    if any(call.module is root for call in local.calls) or any(
        frame.stage.owner is scheduler for frame in local.frames
    ):
        return True
    return observed and _executing()[id(root)] > 0


def _stale_suffix(entries: list[Any], executing: collections.Counter[int]) -> list[Any]:
    """The entries, from the first whose module is not (or no longer) being called."""
    for position, entry in enumerate(entries):
        key = id(entry.module)
        if executing[key] <= 0:
            return entries[position:]
        executing[key] -= 1
    return []


def _record_stream(
    backend: Backend, tensors: list[torch.Tensor], device: torch.device, stream: Stream
) -> int:
    """``record_stream(stream)`` on each of ``tensors`` on ``device``; returns how many."""
    recorded = 0
    for tensor in tensors:
        if tensor.device == device:  # other devices' allocators never see ``stream``
            try:
                backend.record_stream(tensor, stream)
            except RuntimeError:
                # Under torch.func.vmap: no batching rule. Mark the memory under the
                # wrapper instead (checked only on failure, so the common path pays nothing).
                inner = storage_tensor(tensor)
                if inner is None:
                    raise
                backend.record_stream(inner, stream)
            recorded += 1
    return recorded
