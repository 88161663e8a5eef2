"""Deferred joins for ``OOOModule(..., overlap_forward=True)``: join a stage on first touch.

The mechanism behind the lettered steps of the protocol (``scheduler.py``), which
``overlap.DeferredScheduler`` runs. Without it, step 4 makes the caller's stream wait on
the stage's join event ``e`` at once, so stages run one after another in forward. With
it, the wait is *pending* and is queued only when something could read the stage's
results on the caller's stream:

1b. ``s`` also waits on the pending join of each stage whose outputs the call receives,
    or that wrote into one of its inputs in place (:func:`wait_for_inputs`): pending
    outputs are tracked by storage (received directly, through a container, or as a
    view), written inputs by their version counters. The caller's stream stays unjoined,
    so independent siblings overlap.
1c. ``s`` also waits on the pending join of each stage whose module shares a parameter or
    buffer (a storage) with the stage's own (:func:`wait_for_sharing`): a stage may write
    its state in place where no input or output shows it (batch norm's running
    statistics), and another may read or write the same state. Which stages share is
    found once, at install (:func:`share_state`); stages sharing nothing stay concurrent.
4b. The wait on ``e`` is left pending (:func:`defer`): step 4 records ``e`` and restores
    ``ambient`` but does not make it wait yet (it waits at once, as in step 4, if the
    stage raised, runs outside any root call or in a recomputation, or its tensors could
    not all be found).
4c. The first torch operation at the caller's level while a join is pending queues it
    first; so does a stage call that runs inline there. Host reads (``.item()``,
    ``.cpu()``, ``print``) and ``.data_ptr()`` count: ``JoinOnTouch``, a
    ``TorchFunctionMode``, joins everything pending at that level first
    (:func:`join_from`). It is on the mode stack only while a join is pending at the
    current level; a stage's pre-hook takes it off, so a stage's own ops never pass
    through it. It goes under the modes already on the stack, never on top of one, so a
    user's ``with SomeMode():`` around a stage call pops its own mode when it ends; and
    whether it is on the stack is read from the stack each time, so code that popped it
    cannot leave it off for good. A stage call that runs inline runs one level down,
    where the mode does not look: its pre-hook joins first (:func:`join_pending`).
5b. Root post-hook, before step 5: the call's own pending joins are dropped (step 5's
    waits cover them: each event was recorded earlier on one of those streams), and any
    other model's are queued (:func:`finish`). A stage called inside another stage's
    forward leaves its join pending at that inner level; it is completed by whatever
    touches its output later, at any level (4c makes the stream the touching operation
    runs on wait too), so the outer stage's end needs no join of its own. An exception
    leaving the forward reaches the root's post-hook too, which joins everything.

Memory: each stage output is still ``record_stream``\\ ed to the caller's stream at the
stage's return, and each input to the stage's stream at its call (steps 4 and 2), so the
allocator keeps a block until every stream that may use it is done, pending or not.

A stage's inputs or outputs the search cannot see into (``_tensors.tensors_in``: objects
nested too deep, objects without attributes) cannot be tracked by storage: the stage then
waits on every pending join, or is joined at once, so only overlap is lost there.

What cannot be seen: work that never enters PyTorch's Python layer, such as a C++
extension given a tensor at the caller's level; a stage reading another stage's pending
output through an attribute rather than an argument (state shared through a parameter or
buffer is 1c's); a stage writing in place into a tensor that a pending sibling reads
(other than such state); a pending output read on another thread (the mode
and the pending joins are the calling thread's); a read under
``torch._C.DisableTorchFunction()``, which turns every mode off.
``ooo_wrap.testing.check(..., overlap_forward=True)`` reports all but the first as races
when the model does them (another thread's reads if the thread starts inside the check),
and parent code that orders a stream of its own after the caller's (``wait_stream``, an
event) before its first touch: stream and event calls are no torch operations, so that
order misses the pending join unless the touch runs on that stream (see ``join_from``).

Levels: ``level`` is the number of stage calls in flight on the thread (the scheduler's
frame stack), so the caller's level of a stage is the level its post-hook sees after
popping its frame. A touch at one level joins what is pending at that level and
deeper, which includes every inner stage whose output it can reach.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .._compat import (
    ModeArgs,
    ModeFunc,
    ModeKwargs,
    ModeTypes,
    function_mode_position,
    put_function_mode_under,
    storage_id,
    take_function_mode_off,
    tensor_version,
)
from .backend import Backend, Event, Stream
from .inflight import Pending, StageRuntime, thread_state

__all__ = [
    "JoinOnTouch",
    "defer",
    "finish",
    "join_from",
    "join_pending",
    "resume",
    "share_state",
    "suspend",
    "versions",
    "wait_for_inputs",
    "wait_for_sharing",
    "written",
]


class JoinOnTouch(TorchFunctionMode):
    """4c. Joins every join pending at the current level before any torch operation there."""

    def __torch_function__(
        self, func: ModeFunc, types: ModeTypes, args: ModeArgs = (), kwargs: ModeKwargs = None
    ) -> Any:
        local = thread_state
        pending = local.pending
        if pending and not local.quiet:
            level = len(local.frames)
            if pending[-1].level >= level:
                join_from(level, touched=True)
        return func(*args, **(kwargs or {}))


def _keys(tensors: list[torch.Tensor]) -> list[int] | None:
    """Storage identities of ``tensors``; ``None`` if one has no plain storage (vmap)."""
    try:
        return [storage_id(t) for t in tensors]
    except (RuntimeError, NotImplementedError):
        return None


def versions(inputs: list[torch.Tensor]) -> list[int]:
    """The inputs' version counters (-1 where there is none: an inference tensor)."""
    try:
        return [tensor_version(tensor) for tensor in inputs]
    except RuntimeError:
        return [_version(tensor) for tensor in inputs]


def _version(tensor: torch.Tensor) -> int:
    try:
        return tensor_version(tensor)
    except RuntimeError:
        return -1


def written(inputs: list[torch.Tensor], before: list[int]) -> list[torch.Tensor]:
    """The inputs a stage wrote in place (or may have: no version counter to tell)."""
    return [
        tensor
        for tensor, version in zip(inputs, before, strict=True)
        if version < 0 or tensor_version(tensor) != version
    ]


def defer(
    level: int,
    ambient: Stream,
    event: Event,
    stage: StageRuntime,
    outputs: list[torch.Tensor],
    blind: bool = False,
) -> bool:
    """4b. Leave the caller's wait on ``event`` (``stage``'s, recorded on its stream)
    pending; ``False`` if it must be joined now: also when ``blind`` (the search missed
    some of the stage's outputs or inputs, whose storages then cannot be tracked)."""
    keys = None if blind else _keys(outputs)
    if keys is None:
        return False
    entry = Pending(level, ambient, event, stage)
    local = thread_state
    local.pending.append(entry)
    by_storage = local.by_storage
    for key in keys:
        by_storage.setdefault(key, []).append(entry)
    return True


def wait_for_inputs(
    stream: Stream, backend: Backend, inputs: list[torch.Tensor], blind: bool = False
) -> int:
    """1b. Make ``stream`` wait on the pending join of every stage whose output (or a view
    of it) is among ``inputs`` (on every pending join when ``blind``: the search missed
    some inputs); returns how many waits were queued."""
    local = thread_state
    by_storage = local.by_storage
    if not by_storage:
        return 0
    keys = None if blind else _keys(inputs)
    if keys is None:  # cannot tell which: wait on them all
        found = [p for p in local.pending if not p.done]
    else:
        found = []
        for key in keys:
            for entry in by_storage.get(key, ()):
                if not entry.done and entry not in found:
                    found.append(entry)
    for entry in found:
        backend.wait_event(stream, entry.event)
    return len(found)


def share_state(model: nn.Module, stages: Sequence[StageRuntime]) -> None:
    """1c. Set each stage's ``sharing``: the other stages whose module holds a parameter
    or buffer overlapping one its own module holds (a tied weight, a shared norm, a view
    of the same buffer). By the bytes each spans in its storage, so parameters laid out
    side by side in one flat buffer (as sharded or fused optimizers keep them) share
    nothing."""
    spans: dict[int, list[tuple[int, int, int]]] = {}  # storage: (start, end, stage index)
    for stage in stages:
        module = model.get_submodule(stage.name)
        for tensor in itertools.chain(module.parameters(), module.buffers()):
            keys = _keys([tensor])
            key, span = (id(tensor), (0, 1)) if keys is None else (keys[0], _span(tensor))
            spans.setdefault(key, []).append((*span, stage.index))
    sharing: dict[int, set[int]] = {stage.index: set() for stage in stages}
    for items in spans.values():  # a sweep over each storage's spans, in order
        open_spans: list[tuple[int, int]] = []  # (end, stage index)
        for start, end, index in sorted(items):
            open_spans = [(e, i) for e, i in open_spans if e > start]
            for _, other in open_spans:
                if other != index:
                    sharing[index].add(other)
                    sharing[other].add(index)
            open_spans.append((end, index))
    for stage in stages:
        stage.sharing = tuple(sorted(sharing[stage.index]))


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage ``tensor`` spans, ``[start, end)`` (strided views of one
    storage that interleave count as overlapping)."""
    size = tensor.element_size()
    start = int(tensor.storage_offset()) * size
    if tensor.numel() == 0:
        return start, start
    last = sum(
        (n - 1) * abs(stride) for n, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return start, start + (last + 1) * size


def wait_for_sharing(stream: Stream, backend: Backend, stage: StageRuntime) -> int:
    """1c. Make ``stream`` wait on the pending join of every stage that shares a parameter
    or buffer with ``stage`` (its ``sharing``); returns how many waits were queued.

    One wait per other stream: the pending list is in the order the join events were
    recorded, so the newest such event on a stream follows every older one there, and
    work on ``stream`` itself is ordered already. A chain of stages all tied to one
    weight then queues at most one wait per stream, not one per earlier stage.
    """
    sharing, owner = stage.sharing, stage.owner
    covered = [stream]
    for entry in reversed(thread_state.pending):
        other = entry.stage  # maybe a twin: same index and owner, the stream it ran on
        if other.owner is owner and other.index in sharing and other.stream not in covered:
            backend.wait_event(stream, entry.event)
            covered.append(other.stream)
    return len(covered) - 1


def join_from(level: int, *, touched: bool = False) -> None:
    """4c. Queue the caller's wait for every join pending at ``level`` or deeper.

    ``touched``: an operation is about to run at the caller's level. The parent may have
    switched streams itself since the stage returned (``with torch.cuda.stream(own)``,
    after ``own.wait_stream(caller)``, which ordered nothing pending), so the stream the
    operation runs on waits too when it is not the caller's.
    """
    local = thread_state
    pending = local.pending
    while pending and pending[-1].level >= level:
        entry = pending.pop()
        entry.done = True
        owner = entry.stage.owner
        backend = owner._backend
        backend.wait_event(entry.ambient, entry.event)
        owner._counters.joins += 1
        if touched:
            current = backend.current_stream(entry.stage.device)
            if current != entry.ambient:
                backend.wait_event(current, entry.event)
    if not pending:
        local.by_storage.clear()


def join_pending(level: int) -> None:
    """:func:`join_from` for a scheduler hook's own use: queue the caller's wait for
    everything pending at ``level`` or deeper, with the mode kept quiet meanwhile (as
    before a stage runs inline one level down, where :class:`JoinOnTouch` does not look,
    or when an interrupted forward's leftovers are dropped)."""
    suspend()
    try:
        join_from(level)
    finally:
        resume(level)


def finish(first: int, owner: object) -> None:
    """5b. At a root's end: forget ``owner``'s joins pending since the ``first`` (the
    root's per-stream waits, queued next, cover them: each event was recorded earlier on
    one of the call's streams) and join anyone else's."""
    local = thread_state
    pending = local.pending
    while len(pending) > first:
        entry = pending.pop()
        entry.done = True
        other = entry.stage.owner
        if other is not owner:
            other._backend.wait_event(entry.ambient, entry.event)
            other._counters.joins += 1
    if not pending:
        local.by_storage.clear()


def suspend() -> None:
    """Start of a scheduler hook: its own tensor reads must not join. Takes the mode off
    the stack, wherever it is, and keeps it quiet until :func:`resume`."""
    local = thread_state
    local.quiet += 1
    if local.mode is not None:
        take_function_mode_off(local.mode)


def resume(level: int) -> None:
    """End of a scheduler hook: put the mode on the stack iff a join is pending at
    ``level`` (the level the code after the hook runs at)."""
    local = thread_state
    local.quiet -= 1
    pending = local.pending
    if not pending or pending[-1].level < level:
        return
    mode = local.mode
    if mode is None:
        mode = local.mode = JoinOnTouch()
    elif function_mode_position(mode) is not None:
        return
    put_function_mode_under(mode)
