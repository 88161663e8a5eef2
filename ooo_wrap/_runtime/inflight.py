"""What is in flight on a thread while wrapped models run, and the one per-thread state.

The records (stage calls, root calls, pending joins) are plain data that the hooks push
and pop; :data:`thread_state` holds them for every wrapped model at once, with every
other per-thread field of the runtime. This module imports no other module of the
runtime but ``backend``: everything above it reads the thread through it.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .._events import EventLog
from .._plan import Stage
from .._stats import Counters
from .backend import Backend, Event, Stream

__all__ = [
    "NO_INPUTS",
    "Frame",
    "Owner",
    "Pending",
    "RootCall",
    "StageRuntime",
    "ThreadState",
    "handled_exception",
    "pair_tied_stages",
    "thread_state",
]


def _exc_info_value() -> BaseException | None:
    return sys.exc_info()[1]


# The exception being handled here, if any: ``sys.exception()`` (Python 3.11+) returns it
# without building ``sys.exc_info()``'s tuple, a quarter of the cost, twice per stage call.
handled_exception: Callable[[], BaseException | None] = getattr(sys, "exception", _exc_info_value)


NO_INPUTS: list[torch.Tensor] = []  # never appended to


class Owner(Protocol):
    """What the records need of the scheduler that made them (``scheduler.Scheduler``)."""

    _backend: Backend
    _counters: Counters
    _events: EventLog


class StageRuntime:
    """A planned stage bound to its stream object."""

    __slots__ = (
        "attributes",
        "attributes_seen",
        "device",
        "device_type",
        "frame",
        "index",
        "module",
        "name",
        "owner",
        "sharing",
        "stream",
        "stream_index",
        "twin",
    )

    def __init__(self, owner: Owner, stage: Stage, stream: Stream, index: int) -> None:
        self.owner = owner
        self.name = stage.name
        self.index = index  # its position in the plan's stages
        # The module that carries this stage's hooks (set by Scheduler.install), weakly:
        # after model surgery it may no longer be the model's, and must not be kept alive.
        self.module: weakref.ref[nn.Module] | None = None
        self.device = stage.device
        self.device_type = stage.device.type
        self.stream_index = stage.stream
        self.stream = stream
        # Under autocast, this stage as run on the stream of another stage it shares a
        # weight with (see pair_tied_stages); None when it shares none.
        self.twin: StageRuntime | None = None
        # The indexes of the other stages whose module shares a parameter or buffer with
        # this one's (set by DeferredScheduler.install_stages; see deferred.share_state).
        self.sharing: tuple[int, ...] = ()
        # Its frame, reused from call to call by the thread that made it (see Frame). Kept
        # here, not per thread, so that it goes with the stage: a dropped model is freed
        # whichever threads ran it.
        self.frame: Frame | None = None
        # The names of the module's own attributes that may hold a tensor it stores
        # instead of returning (``self.last = y``), and the size of its ``__dict__`` when
        # they were listed (a new attribute lists them again); see scheduler.py, step 4.
        self.attributes: tuple[str, ...] = ()
        self.attributes_seen = -1


class Frame:
    """One stage call in flight on this thread; ``ambient is None`` when bypassed.

    A forked call reuses its stage's frame (``StageRuntime.frame``) with the stage's fork
    and join events: creating an event costs a driver call, and a frame an allocation, on
    every stage call. Only the thread that made the frame reuses it (``thread``); a call on
    another thread, or a stage called again inside itself (``busy``), gets a fresh one.
    Each call sets what is its own (the module too), and its post-hook clears what would
    keep the call's objects alive. Within a thread each event record is followed at once by
    its wait, so a re-record never moves a wait already queued; a join left pending takes
    its event away with it (``DeferredScheduler``), so the next call records a fresh one.
    """

    # ``versions`` is set and read only by DeferredScheduler's hooks, so plain frames never
    # pay for it; ``profile_range`` is None except between ProfiledScheduler's hooks.
    __slots__ = (
        "ambient",
        "blind",
        "busy",
        "fork",
        "inputs",
        "join",
        "module",
        "outer_exception",
        "profile_range",
        "stage",
        "thread",
        "versions",
    )
    versions: list[int]  # the inputs' version counters at the call (deferred joins)

    def __init__(self, stage: StageRuntime, module: nn.Module) -> None:
        self.stage = stage
        self.module: nn.Module | None = module  # while the call is in flight
        self.thread = threading.get_ident()
        self.ambient: Stream | None = None  # the caller's stream, while forked
        self.fork: Event | None = None
        self.join: Event | None = None
        self.inputs = NO_INPUTS  # the input tensors found (deferred joins track writes)
        self.blind = False  # the search missed some inputs
        # The exception being handled around the call, if any: the post-hook tells a
        # stage that raised from one called inside an ``except`` block by comparing.
        self.outer_exception = handled_exception()
        self.busy = False
        self.profile_range: torch.profiler.record_function | None = None


class RootCall:
    """One call of a wrapped model's root in flight on this thread."""

    __slots__ = (
        "bypass",
        "called",
        "first_pending",
        "frames",
        "module",
        "owner",
        "ran_inline",
        "used",
    )

    def __init__(
        self,
        owner: Owner,
        module: nn.Module,
        bypass: str | None,
        local: ThreadState,
        stages: int,
        streams: int,
    ) -> None:
        self.owner = owner
        self.module = module
        # Why every stage call of it runs inline, decided once at the root (the
        # scheduler's _root_bypass), or None; a tuner may set it before any stage runs.
        self.bypass = bypass
        self.first_pending = len(local.pending)  # joins pending before it: not its to end
        # By stage index, whether it ran on its stream; by stream index, whether a stage
        # ran on it. Flags, not sets: a store per stage call, never a resize.
        self.called = [False] * stages
        self.used = [False] * streams
        self.ran_inline = False  # some stage call was bypassed (ran on the caller's stream)
        # The calling thread's ``frames`` (the same list, never replaced): a stage hook
        # inside the call reads it here, not through the thread state.
        self.frames = local.frames


class Pending:
    """A stage call whose caller's stream has not yet waited on its join event (step 4b
    of the protocol in ``scheduler.py``; the mechanism is ``deferred.py``). The backend,
    counters and device are the stage's."""

    __slots__ = ("ambient", "done", "event", "level", "stage")

    def __init__(self, level: int, ambient: Stream, event: Event, stage: StageRuntime) -> None:
        self.level = level  # the caller's level: stage calls in flight after it returned
        self.ambient = ambient
        self.event = event
        self.stage = stage  # as run: its twin, if it ran on a tied stage's stream
        self.done = False  # joined; it may still be listed under a storage


class ThreadState(threading.local):
    """Everything the runtime keeps per thread, for every wrapped model at once.

    Shared by all schedulers, so that the hooks of two wrapped models on one module (a
    stage module shared by both) can tell whose call it is: a stage hook acts only for the
    innermost root call in flight, or, outside any root call (e.g. a checkpoint
    recomputing a stage in backward), only if no other model already forked this call.
    The only ``threading.local`` of the runtime: each field read through it costs a
    look-up of the thread's dictionary, so a hook reads each field once.
    """

    def __init__(self) -> None:
        # ``frames`` and ``calls`` are changed in place, never replaced: each RootCall
        # keeps a reference to ``frames`` for the stage hooks inside it.
        self.frames: list[Frame] = []  # stage calls in flight, innermost last
        self.calls: list[RootCall] = []  # root calls in flight, innermost last
        # Inside a checkpoint's unpack hook (it may recompute): the (backend, device) of
        # each stage call run there (recompute.py); None elsewhere.
        self.recomputing: list[tuple[Backend, torch.device]] | None = None
        self.disabled = 0  # depth of ooo_wrap.disabled() blocks (bypass.py)
        # Deferred joins (deferred.py): the pending ones, innermost level last; each
        # pending output's storage to the joins that made it; the join-on-touch mode,
        # made once per thread; and >0 inside a hook whose own tensor reads must not join.
        self.pending: list[Pending] = []
        self.by_storage: dict[int, list[Pending]] = {}
        self.mode: TorchFunctionMode | None = None
        self.quiet = 0


thread_state = ThreadState()


def pair_tied_stages(model: nn.Module, stages: Sequence[StageRuntime]) -> bool:
    """Give each stage that shares a parameter with an earlier one a twin on its stream.

    Autocast caches the low-precision copy of a weight for the rest of the autocast
    region. With a weight tied across two stages, the copy cast in one stage (allocated
    on its stream) would be read by the other on another stream, with no
    ``record_stream``: freed into the first stream's pool while the second may still read
    it in backward. Under autocast such stages run on one stream (the first one's): the
    copy is then made and read on that stream only, and the graph and its gradients are
    exactly the plain model's. The cost: no backward overlap between those stages under
    autocast. Returns whether any stage got a twin.
    """
    first_user: dict[int, StageRuntime] = {}
    leader: dict[StageRuntime, StageRuntime] = {}
    for stage in stages:
        leader[stage] = stage
        for parameter in model.get_submodule(stage.name).parameters():
            other = first_user.setdefault(id(parameter), stage)
            if other is not stage and leader[stage] is stage:
                leader[stage] = leader[other]
    paired = False
    for stage, lead in leader.items():
        if lead is not stage and lead.stream_index != stage.stream_index:
            twin = copy.copy(stage)
            twin.stream, twin.stream_index, twin.twin = lead.stream, lead.stream_index, None
            twin.frame = None
            stage.twin = twin
            paired = True
    return paired
