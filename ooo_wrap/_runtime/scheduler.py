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
   ``ambient``; so does each tensor held in a plain attribute of the stage's module,
   which may be a result stored instead of returned (``self.last = y``; an
   ``UNTRACKED``/``attribute`` event says so, once); an event ``e`` is recorded on
   ``s``; ``ambient`` is restored and waits on ``e``, so no untracked parent op can read
   an unfinished stage.
5. Root post-hook: the current stream waits on every stage stream used in the call,
   before the output (and the loss) reaches the host.

With ``overlap_forward`` (``overlap.DeferredScheduler``, the mechanism in ``deferred.py``)
the wait of step 4 is left pending until something touches the stage's results; the
lettered steps extend the numbered step they follow:

1b. ``s`` also waits on the pending join of each stage whose outputs the call receives,
    or that wrote into one of its inputs in place.
1c. ``s`` also waits on the pending join of each stage whose module shares a parameter or
    buffer with its own (which a stage may write in place: batch norm's statistics).
4b. The wait on ``e`` is left pending: step 4 records ``e`` and restores ``ambient`` but
    does not make it wait yet (it waits at once, as in step 4, if the stage raised, runs
    outside any root call or in a recomputation, or its tensors could not all be found).
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
the capture's boundary.

Step 2 is kept under capture, and needed there. PyTorch's caching allocator
(c10/cuda/CUDACachingAllocator.cpp, as read at pytorch/pytorch 001074d): free() of a block
with stream uses while any capture is underway pushes it on
needs_events_deferred_until_no_capture instead of freeing it; only
insert_events_deferred_until_no_capture(), called from process_events() and
synchronize_and_free_events() once no capture is underway, inserts its events (less the
streams recorded during the capture, which must have rejoined) and frees it. So the block
is never reused inside the capture. Without ``record_stream`` it would be, on ``ambient``
while ``s`` still reads it: a graph is a fixed schedule, so that race would happen in
every replay. The cost: such blocks stay held in the graph's private pool until the
capture ends instead of being reused within it.

The root hooks (step 5, and what a forward opens and closes) are ``roots.RootHooks``,
which this class extends. ``profiling.ProfiledScheduler`` adds profiler ranges around
steps 3-4 by overriding the two stage hooks, so a model wrapped without ``profile_ranges``
pays nothing for them; the class is picked once, at install (``variants.py``).
"""

from __future__ import annotations

import functools
import logging
import weakref
from threading import get_ident
from typing import Any

import torch
from torch import Tensor, nn
from torch.compiler import is_compiling
from torch.utils.hooks import RemovableHandle

from .._compat import is_checkpoint_early_stop, storage_tensor
from .._tensors import tensors_in
from . import reports
from .backend import Backend, Event, Stream
from .bypass import eager_bypass_reason
from .deferred import join_pending
from .inflight import (
    NO_INPUTS,
    Frame,
    StageRuntime,
    handled_exception,
    pair_tied_stages,
    thread_state,
)
from .recompute import record_leaf_grads
from .roots import RootHooks
from .stale import running

__all__ = ["Scheduler", "running"]


class Scheduler(RootHooks):
    """Hooks that run each stage of one wrapped model on its side stream, joining each
    stage's call at once (step 4); the root hooks are :class:`RootHooks`'."""

    def install(self, model: nn.Module, handles: list[RemovableHandle]) -> None:
        """Register the hooks, appending each handle to ``handles`` as soon as it exists."""
        handles.append(
            model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True, prepend=True)
        )
        handles.append(
            model.register_forward_hook(self._root_post_hook, with_kwargs=True, always_call=True)
        )
        self.install_stages(model, handles)

    def install_stages(self, model: nn.Module, handles: list[RemovableHandle]) -> None:
        """Register the stage hooks only (measured tuning calls the root hooks itself)."""
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

    # --- stage hooks: the hot path, once per stage call ------------------------------

    def _stage_pre_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any
    ) -> None:
        if is_compiling():
            return  # inline in the compiled graph; the root pre-hook noted it
        local = thread_state
        calls = local.calls
        if calls:
            call = calls[-1]
            if call.owner is not self:
                return  # another wrapped model's call reached a module we share with it
            # The thread's own list, kept on its root call: a read of ``thread_state``
            # costs a look-up of the thread's dictionary, a slot read does not.
            frames = call.frames
            reason = call.bypass
        else:  # outside any root call: a checkpoint recomputing it in backward, a direct call
            frames = local.frames
            if frames and frames[-1].module is module and frames[-1].stage.owner is not self:
                return  # a model sharing this module already forked
            reason = eager_bypass_reason()
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
        if not calls and recomputing is None:
            # Outside any forward, maybe a reentrant checkpoint recomputing in its node:
            # the gradients it returns are made on s (recompute.py).
            record_leaf_grads(inputs, backend, ambient)
        frame = stage.frame
        if frame is None:
            frame = stage.frame = Frame(stage, module)
        elif frame.busy or frame.thread != get_ident():
            frame = Frame(stage, module)  # it runs already (calls itself), or another thread's
        else:
            frame.module = module
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
                if isinstance(output, Tensor):  # as the pre-hook's common case
                    outputs, blind = [output], False
                else:
                    outputs, blind = self._search(stage, output, None)
                device = stage.device
                recorded = 0
                attributes = module.__dict__
                if len(attributes) != stage.attributes_seen:
                    _list_attributes(stage, attributes)
                for name in stage.attributes:
                    kept = attributes.get(name)
                    if (
                        isinstance(kept, Tensor)
                        and kept.device == device
                        and all(kept is not out for out in outputs)
                    ):
                        outputs = [*outputs, kept]  # maybe a result that escapes through it
                        self._report_kept(stage, name)
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
        frame.module = None
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

    def _report_kept(self, stage: StageRuntime, name: str) -> None:
        """Record once per (stage, attribute) a tensor held in an attribute of the stage."""
        if (stage.name, f".{name}") not in self._unseen_reported:
            self._unseen_reported.add((stage.name, f".{name}"))
            self._events.add(reports.kept_in_attribute(stage, name), level=logging.INFO)

    def _report_unseen(self, stage: StageRuntime, unseen: list[str]) -> None:
        """Record once per (stage, type) an input or output the hooks could not search."""
        for name in unseen:
            if (stage.name, name) not in self._unseen_reported:
                self._unseen_reported.add((stage.name, name))
                self._events.add(reports.untracked(stage, name), level=logging.WARNING)


# The attributes every module has (its parameters, hooks, ...): never a stored result.
_MODULE_STATE = frozenset(vars(nn.Module()))


def _list_attributes(stage: StageRuntime, attributes: dict[str, Any]) -> None:
    """List the module's own attributes that hold a tensor or ``None`` (``self.last =
    None`` in ``__init__``), off the hot path: only when the module's ``__dict__`` changed
    size. An attribute holding something else then (a size, a flag) is not looked at on
    each call: a tensor assigned to it later is missed (``check()`` reports that)."""
    stage.attributes = tuple(
        name
        for name, value in attributes.items()
        if name not in _MODULE_STATE and (value is None or isinstance(value, Tensor))
    )
    stage.attributes_seen = len(attributes)


def _record_storage(backend: Backend, tensor: torch.Tensor, stream: Stream) -> None:
    """``record_stream`` failed on ``tensor``: under ``torch.func.vmap`` there is no batching
    rule, so mark the memory under the wrapper instead (looked for only on failure, so the
    common path pays nothing)."""
    inner = storage_tensor(tensor)
    if inner is None:
        raise
    backend.record_stream(inner, stream)
