"""Profiler ranges named after the stages: ``OOOModule(..., profile_ranges=True)``.

A subclass of the scheduler rather than a flag inside it: the class is picked once at
install (``variants.py``), so a model wrapped without ``profile_ranges`` runs the plain
hooks and pays nothing for the option on the hot path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.compiler import is_compiling

from .inflight import StageRuntime, thread_state
from .scheduler import Scheduler

__all__ = ["ProfiledScheduler"]


class ProfiledScheduler(Scheduler):
    """The scheduler, with each stage call inside ``record_function("ooo/<stage>")``.

    The range opens in the pre-hook after the switch to the stage's stream and closes in
    the post-hook (which always runs) after the join, so it holds the stage's forward and
    the scheduler's own work for it, and stays properly nested even when the stage raises.
    Bypassed calls (``ooo_wrap.disabled()``, ``no_grad``, tracing) get their range too:
    it names the stage, whichever stream ran it. Under ``torch.compile`` the hooks do
    nothing, so there is no range.
    """

    def _stage_pre_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any
    ) -> None:
        if is_compiling():
            return  # the plain hook does nothing there: no frame, no range in a graph
        frames = thread_state.frames
        depth = len(frames)
        super()._stage_pre_hook(stage, module, args, kwargs)
        if len(frames) == depth:
            return  # another wrapped model's call of a module shared with it: no range
        profile_range = torch.profiler.record_function(f"ooo/{stage.name}")
        profile_range.__enter__()  # type: ignore[no-untyped-call]  # untyped in torch
        frames[-1].profile_range = profile_range  # the frame just pushed

    def _stage_post_hook(
        self, stage: StageRuntime, module: nn.Module, args: Any, kwargs: Any, output: Any
    ) -> None:
        if is_compiling():
            return  # as the plain hook: nothing was opened
        frames = thread_state.frames
        profile_range = None
        if frames and (frames[-1].stage is stage or frames[-1].stage is stage.twin):
            # None when opening the range raised in the pre-hook: nothing to close then.
            # Taken off the frame, which the stage's next call reuses.
            profile_range, frames[-1].profile_range = frames[-1].profile_range, None
        try:
            super()._stage_post_hook(stage, module, args, kwargs, output)
        finally:
            # Closed whatever happened, so later ranges are not nested inside this one.
            if profile_range is not None:
                profile_range.__exit__(None, None, None)
