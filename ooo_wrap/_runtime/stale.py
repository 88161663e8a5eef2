"""Stale-call recovery: undo what interrupted forwards left in flight on a thread.

``always_call`` post-hooks run for an ``Exception`` but not for a bare ``BaseException``
such as ``KeyboardInterrupt``, so a stage interrupted that way leaves its stream current
and its frame (and its root call) in flight. The scheduler's root pre-hook, ``replan()``
and ``unwrap()`` call in here when something is in flight; a plain forward never does.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from torch import nn

from .._compat import module_calls_on_stack
from . import deferred as _deferred
from . import reports
from .inflight import NO_INPUTS, Owner, thread_state

__all__ = ["drop_stale_calls", "running"]


def drop_stale_calls(root: nn.Module | None) -> None:
    """Undo what interrupted forwards left behind on this thread, as ``root`` starts (or
    as ``replan()`` or ``unwrap()`` is called, with no root).

    A call still in flight is one whose module is still being called on the Python stack
    (the root may legitimately run inside one of its own stages); only the rest are
    stale. Walking the stack costs tens of microseconds, paid only when a root starts
    with something in flight.
    """
    executing = module_calls_on_stack()
    if root is not None:
        executing[id(root)] -= 1  # the call starting now
    local = thread_state
    stale_calls = _stale_suffix(local.calls, executing.copy())
    stale_frames = _stale_suffix(local.frames, executing)
    if not stale_calls and not stale_frames:
        return
    outermost = next((f for f in stale_frames if f.ambient is not None), None)
    owners: dict[int, Owner] = {id(c.owner): c.owner for c in stale_calls}
    owners.update((id(f.stage.owner), f.stage.owner) for f in stale_frames)
    del local.calls[len(local.calls) - len(stale_calls) :]
    del local.frames[len(local.frames) - len(stale_frames) :]
    for frame in stale_frames:
        frame.busy = False  # a stage's reused frame is free again
        frame.outer_exception, frame.inputs, frame.module = None, NO_INPUTS, None
    if outermost is not None:
        outermost.stage.owner._backend.set_stream(outermost.ambient)  # step 4's restore
    _deferred.join_pending(len(local.frames))  # what they left pending (step 4c)
    for owner in owners.values():
        owner._events.add(reports.interrupted(), level=logging.INFO)


def running(root: nn.Module, scheduler: Owner | None, observed: bool = False) -> bool:
    """Whether a call of ``root`` (observed by the dataflow planner when ``observed``), or
    of one of ``scheduler``'s stages, is running on this thread. What interrupted
    forwards left in flight is undone first: those calls are over."""
    local = thread_state
    if local.calls or local.frames:
        drop_stale_calls(None)
    if any(call.module is root for call in local.calls) or any(
        frame.stage.owner is scheduler for frame in local.frames
    ):
        return True
    return observed and module_calls_on_stack()[id(root)] > 0


def _stale_suffix(entries: list[Any], executing: collections.Counter[int]) -> list[Any]:
    """The entries, from the first whose module is not (or no longer) being called."""
    for position, entry in enumerate(entries):
        key = id(entry.module)
        if executing[key] <= 0:
            return entries[position:]
        executing[key] -= 1
    return []
