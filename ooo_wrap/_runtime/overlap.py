"""The scheduler with deferred joins: ``OOOModule(..., overlap_forward=True)``.

A subclass rather than a flag inside the scheduler: the class is picked once at install
(``variants.py``), so a model wrapped without ``overlap_forward`` runs the plain hooks and
never tests for it. Each hook here runs the plain one (``super()``) with the join-on-touch
mode quiet, so the hook's own reads of the tensors do not count as touches, and adds the
lettered steps of the protocol (``scheduler.py``; the mechanism is ``deferred.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.compiler import is_compiling
from torch.utils.hooks import RemovableHandle

from . import deferred as _deferred
from .backend import Event
from .bypass import eager_bypass_reason
from .inflight import Frame, StageRuntime, handled_exception, thread_state
from .scheduler import Scheduler

__all__ = ["DeferredScheduler"]


class DeferredScheduler(Scheduler):
    """The scheduler, with each stage's join with the caller's stream left pending until
    something touches the stage's results."""

    _sharing_found = False  # set on the instance once its stages' sharing is found

    def install_stages(self, model: nn.Module, handles: list[RemovableHandle]) -> None:
        super().install_stages(model, handles)
        if not self._sharing_found:  # 1c: found once (tuning installs at every switch)
            _deferred.share_state(model, self._stages)
            self._sharing_found = True

    def _root_bypass(self) -> str | None:
        # A no_grad forward has stages to overlap too (its forward), so it forks.
        return eager_bypass_reason()

    def _root_post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if is_compiling():
            return
        local = thread_state
        calls = local.calls
        if calls and calls[-1].module is module:  # else the plain hook ignores it too
            # 5b. The waits of step 5 cover every join this call left pending.
            _deferred.suspend()
            try:
                _deferred.finish(calls[-1].first_pending, self)
            finally:
                _deferred.resume(len(local.frames))
        super()._root_post_hook(module, args, kwargs, output)

    def _stage_pre_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any
    ) -> None:
        if is_compiling():
            return  # inline in the compiled graph, nothing deferred
        frames = thread_state.frames
        depth = len(frames)
        _deferred.suspend()  # the hook's own reads of the inputs must not join
        try:
            super()._stage_pre_hook(stage, module, args, kwargs)
            if len(frames) > depth and frames[-1].ambient is not None:  # it forked
                frame = frames[-1]
                # Before the stage runs: an input it writes in place is left pending with
                # its outputs (4b), for the next stage call that receives it (1b).
                frame.versions = _deferred.versions(frame.inputs)
                # 1b. s also waits on the pending join of each stage whose outputs the
                # call receives, or that wrote into one of its inputs in place.
                self._counters.waits += _deferred.wait_for_inputs(
                    frame.stage.stream, self._backend, frame.inputs, frame.blind
                )
                # 1c. And on that of each stage sharing a parameter or buffer with it
                # (``stage``'s list: ``frame.stage`` may be its twin, a copy made before).
                if stage.sharing:
                    self._counters.waits += _deferred.wait_for_sharing(
                        frame.stage.stream, self._backend, stage
                    )
        finally:
            _deferred.resume(len(frames))

    def _stage_post_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        if is_compiling():
            return  # inline in the compiled graph, nothing deferred
        _deferred.suspend()
        try:
            super()._stage_post_hook(stage, module, args, kwargs, output)
        finally:
            _deferred.resume(len(thread_state.frames))

    def _join(self, frame: Frame, event: Event, outputs: list[torch.Tensor], blind: bool) -> None:
        # 4b. Left pending when nothing failed and a root call will join it; the outputs'
        # record_stream of step 4 holds either way.
        local = thread_state
        if (
            local.calls
            and local.recomputing is None  # a recomputation's end event must follow it
            and handled_exception() is frame.outer_exception
            and _deferred.defer(
                len(local.frames),
                frame.ambient,
                event,
                frame.stage,
                outputs + _deferred.written(frame.inputs, frame.versions),
                blind or frame.blind,
            )
        ):
            frame.join = None  # the pending join keeps this record; the next call makes its own
            return
        super()._join(frame, event, outputs, blind)
