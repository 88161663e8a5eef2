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

With ``overlap_forward`` (``overlap.DeferredScheduler``, the mechanism in ``deferred.py``)
the wait of step 4 is left pending until something touches the stage's results; the
lettered steps extend the numbered step they follow:

1b. ``s`` also waits on the pending join of each stage whose outputs the call receives.
4b. The wait on ``e`` is left pending (queued at once, as in step 4, if the stage raised,
    runs outside any root call or in a recomputation, or its tensors could not all be
    searched).
4c. The first torch operation at the caller's level while a join is pending queues it
    first; so does a stage call that runs inline there.
5b. Root post-hook, before step 5: the call's own pending joins are dropped (step 5's
    waits cover them), and any other model's are queued.

The hooks of ``DeferredScheduler`` also keep the join-on-touch mode quiet while they read
the tensors themselves.

Under CUDA graph capture on the caller's stream the same steps are what the capture
needs, so nothing changes: step 1's event, recorded on the capturing stream and waited
on by ``s``, pulls ``s`` into the capture; step 4's wait brings it back, and step 5 makes
every side stream used rejoin before the caller can end the capture (5b finishing the
pending joins first). The events are re-recorded on every call, so no wait ever crosses
the capture's boundary. Step 2 is kept under capture, and needed there: PyTorch's
caching allocator (c10/cuda/CUDACachingAllocator.cpp, as read at pytorch/pytorch 001074d)
holds a block with stream uses that is freed while a capture is underway
(needs_events_deferred_until_no_capture) and frees it only once no capture is, so it is
never reused inside the capture. Without ``record_stream`` it would be, on ``ambient``
while ``s`` still reads it: a graph is a fixed schedule, so that race would happen in
every replay. The cost: such blocks stay in the graph's private pool until the capture
ends instead of being reused within it.

``profiling.ProfiledScheduler`` adds profiler ranges around steps 3-4 by overriding the
two stage hooks, so a model wrapped without ``profile_ranges`` pays nothing for them; the
class is picked once, at install (``variants.py``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Sequence
from typing import Any, NoReturn, SupportsIndex

import torch
from torch import Tensor, nn
from torch.compiler import is_compiling
from torch.utils.hooks import RemovableHandle

from .._compat import is_checkpoint_early_stop
from .._errors import OOOError
from .._events import EventLog
from .._plan import Plan
from .._stats import Counters
from .._tensors import storage_tensor, tensors_in
from . import reports
from .accumulators import Accumulators
from .backend import Backend, Event, Stream
from .bypass import eager_bypass_reason
from .deferred import join_pending
from .inflight import (
    NO_INPUTS,
    Frame,
    RootCall,
    StageRuntime,
    handled_exception,
    pair_tied_stages,
    thread_state,
)
from .stale import drop_stale_calls, running

__all__ = ["Scheduler", "running"]


class Scheduler:
    """Hooks that run each stage of one wrapped model on its side stream, joining each
    stage's call at once (step 4)."""

    def __init__(
        self,
        plan: Plan,
        streams: Sequence[Stream],
        backend: Backend,
        events: EventLog,
        counters: Counters,
    ) -> None:
        self._backend = backend
        self._device = plan.stages[0].device
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
        # The class's functions with this scheduler and the stage bound: one call layer
        # per hook call (a partial of a bound method has two). Looked up on the class, so
        # a subclass (deferred joins, profiler ranges) gets its own.
        pre_hook, post_hook = type(self)._stage_pre_hook, type(self)._stage_post_hook
        for stage in self._stages:
            module = model.get_submodule(stage.name)
            stage.module = weakref.ref(module)
            pre = functools.partial(pre_hook, self, stage)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            post = functools.partial(post_hook, self, stage)
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
        """Forget this thread's reused frames and events of the stages and the root (its
        hooks are gone): they would keep the scheduler, its streams and its log alive for
        as long as the thread."""
        local = thread_state
        local.root_events.pop(self, None)
        stage_frames = local.stage_frames
        for stage in self._stages:
            stage_frames.pop(stage, None)
            if stage.twin is not None:
                stage_frames.pop(stage.twin, None)

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

    # --- root hooks: once per forward ------------------------------------------------

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
            len(local.pending),
            len(self._stages),
            len(self._streams),
        )
        local.calls.append(call)
        accumulators = self.accumulators
        if accumulators is not None and call.bypass != "no_grad" and not self.layout_by_tuner:
            # Before any op of the forward: if it runs on other streams than the previous
            # one, the accumulators that one made are released, so each parameter's is
            # made where this forward first uses it.
            accumulators.begin(module, "inline" if call.bypass is not None else "planned")

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
        events = local.root_events.get(self)
        if events is None:
            events = local.root_events[self] = [None] * len(self._streams)
        for index, stream in enumerate(self._streams):
            if used[index]:
                # 5. The caller's stream waits on all the call's stage streams.
                events[index] = event = backend.record_event(stream, events[index])
                backend.wait_event(current, event)
        self._counters.joins += used.count(True)

    # --- stage hooks: the hot path, once per stage call ------------------------------

    def _stage_pre_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any
    ) -> None:
        if is_compiling():
            return  # inline in the compiled graph; the root pre-hook noted it
        local = thread_state
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
        recomputing = local.recomputing
        if recomputing is not None:
            # A checkpoint recomputing in backward, forked or inline: what this call saves
            # is ordered for each node that reads it as the unpack hook returns, on
            # whatever stream that node runs (recompute.py).
            recomputing.append((backend, stage.device))
        if reason is not None:
            if local.pending:
                # 4c. It runs on the caller's stream, one level down where no touch is
                # seen: join first what is pending there (this model's, or another's with
                # overlap_forward whose forward calls this model).
                join_pending(len(frames))
            self._counters.bypasses += 1
            self._bypass_event(reason)
            frames.append(Frame(stage, module))
            if calls:
                call.ran_inline = True
            return
        if calls:
            call.called[stage.index] = True
        if (
            self._tied_weights
            and stage.twin is not None
            and torch.is_autocast_enabled(stage.device_type)
        ):
            stage = stage.twin  # share the stream whose cached weight copy it will read
        stream = stage.stream
        device = stage.device
        ambient = backend.current_stream(device)
        # 2. Inputs: s may read them in backward; keep their blocks from ambient's reuse.
        # Before step 1's event, which must cover it (see the module docstring).
        arg = args[0] if len(args) == 1 else args  # a tuple's tensors are its items'
        if isinstance(arg, Tensor) and not kwargs:
            inputs, blind = [arg], False  # the common case, without a search
        else:  # ``blind``: some input tensors may be missing from ``inputs``
            inputs, blind = self._search(stage, arg, kwargs)
        # Inline here and in the post-hook (a helper call would cost a third of the loop).
        recorded = 0
        for tensor in inputs:
            if tensor.device == device:  # other devices' allocators never see ``stream``
                try:
                    backend.record_stream(tensor, stream)
                except RuntimeError:
                    _record_storage(backend, tensor, stream)
                recorded += 1
        frame = local.stage_frames.get(stage)
        if frame is None:
            frame = local.stage_frames[stage] = Frame(stage, module)
        elif frame.busy:
            frame = Frame(stage, module)  # the stage runs already, and calls itself
        # 1. s waits on everything queued on ambient so far.
        frame.fork = fork = backend.record_event(ambient, frame.fork)
        backend.wait_event(stream, fork)
        # 3. Switch last, so a failure above leaves the caller's stream untouched.
        backend.set_stream(stream)
        frame.ambient = ambient
        frame.inputs = inputs
        frame.blind = blind
        frame.outer_exception = handled_exception()
        frame.busy = True
        frames.append(frame)
        if calls:
            call.used[stage.stream_index] = True
        counters = self._counters
        counters.stage_calls += 1
        counters.waits += 1
        counters.record_streams += recorded

    def _stage_post_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        if is_compiling():
            return
        frames = thread_state.frames
        if not frames:
            return  # our pre-hook did not run for this call (an earlier pre-hook raised)
        frame = frames[-1]
        if frame.stage is not stage and frame.stage is not stage.twin:
            return  # as above
        frames.pop()
        frame.busy = False
        stage = frame.stage  # its twin, if it ran on a tied stage's stream
        ambient = frame.ambient
        if ambient is not None:
            backend = self._backend
            try:
                # 4. Outputs are read on ambient from now on; e then marks all the stage's
                # work, record_stream included (see step 2 for why that order).
                if isinstance(output, Tensor):
                    outputs, blind = [output], False
                else:
                    outputs, blind = self._search(stage, output, None)
                device = stage.device
                recorded = 0
                for tensor in outputs:
                    if tensor.device == device:
                        try:
                            backend.record_stream(tensor, ambient)
                        except RuntimeError:
                            _record_storage(backend, tensor, ambient)
                        recorded += 1
                frame.join = event = backend.record_event(stage.stream, frame.join)
            finally:
                backend.set_stream(ambient)
            self._join(frame, event, outputs, blind)
            self._counters.record_streams += recorded
        outer_exception = frame.outer_exception
        frame.outer_exception = None  # the reused frame must not keep them alive
        frame.inputs = NO_INPUTS
        error = handled_exception()
        # A checkpoint that stops recomputing early raises through the stage on purpose.
        if (
            error is not None
            and error is not outer_exception
            and not is_checkpoint_early_stop(error)
        ):
            self._counters.failures += 1
            self._events.add(reports.stage_failed(stage, error), level=logging.INFO)

    def _join(self, frame: Frame, event: Event, outputs: list[torch.Tensor], blind: bool) -> None:
        """4. The caller's stream waits on ``event``, which marks all the stage's work.
        (``DeferredScheduler`` leaves it pending instead, where it can: 4b.)"""
        self._backend.wait_event(frame.ambient, event)
        self._counters.joins += 1

    def _search(
        self, stage: StageRuntime, value: Any, kwargs: dict[str, Any] | None
    ) -> tuple[list[torch.Tensor], bool]:
        """The tensors in ``value`` and ``kwargs``, and whether the search missed some."""
        unseen: list[str] = []
        found = tensors_in(value, unseen)
        if kwargs:
            found += tensors_in(kwargs, unseen)
        if unseen:
            self._report_unseen(stage, unseen)
        return found, bool(unseen)

    # --- reports ---------------------------------------------------------------------

    def _report_not_called(self, root: nn.Module, called: list[bool]) -> None:
        """Say once per stage that a forward finished without calling it."""
        for stage in self._stages:
            if called[stage.index] or stage.name in self._not_called_reported:
                continue
            self._not_called_reported.add(stage.name)
            event = reports.not_called(root, stage, self.stage_name_of)
            self._events.add(event, level=logging.WARNING)

    def _report_unseen(self, stage: StageRuntime, unseen: list[str]) -> None:
        """Record once per (stage, type) an input or output the hooks could not search."""
        for name in unseen:
            if (stage.name, name) not in self._unseen_reported:
                self._unseen_reported.add((stage.name, name))
                self._events.add(reports.untracked(stage, name), level=logging.WARNING)

    def _bypass_event(self, reason: str, count: int = 1) -> None:
        self._events.add(reports.bypassed(reason, count), level=logging.INFO)


def _record_storage(backend: Backend, tensor: torch.Tensor, stream: Stream) -> None:
    """``record_stream`` failed on ``tensor``: under ``torch.func.vmap`` there is no batching
    rule, so mark the memory under the wrapper instead (looked for only on failure, so the
    common path pays nothing)."""
    inner = storage_tensor(tensor)
    if inner is None:
        raise
    backend.record_stream(inner, stream)
