"""What is in flight on a thread while wrapped models run: stage calls and root calls.

The scheduler's hooks push and pop these; one :data:`thread_state` is shared by every
wrapped model, so that the hooks of two models sharing a stage module can tell whose call
it is.
"""

from __future__ import annotations

import copy
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._plan import Stage
from . import deferred as _deferred
from .backend import Backend, Stream
from .bypass import eager_bypass_reason

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = [
    "NO_EVENTS",
    "Frame",
    "RootCall",
    "RootEvents",
    "StageRuntime",
    "ThreadState",
    "pair_tied_stages",
    "stage_depth",
    "thread_state",
]


class StageRuntime:
    """A planned stage bound to its stream object."""

    __slots__ = (
        "device",
        "device_type",
        "module",
        "name",
        "owner",
        "stream",
        "stream_index",
        "twin",
    )

    def __init__(self, owner: Scheduler, stage: Stage, stream: Stream) -> None:
        self.owner = owner
        self.name = stage.name
        # The module that carries this stage's hooks (set by Scheduler.install), weakly:
        # after model surgery it may no longer be the model's, and must not be kept alive.
        self.module: weakref.ref[nn.Module] | None = None
        self.device = stage.device
        self.device_type = stage.device.type
        self.stream_index = stage.stream
        self.stream = stream
        # Under autocast, this stage as run on the stream of another stage it shares a
        # weight with (see Scheduler.install); None when it shares none.
        self.twin: StageRuntime | None = None


class Frame:
    """One stage call in flight on this thread; ``ambient is None`` when bypassed."""

    # ``profile_range`` is set and read only by ProfiledScheduler's hooks, so plain frames
    # never pay for it.
    __slots__ = (
        "ambient",
        "blind",
        "events",
        "inputs",
        "module",
        "outer_exception",
        "profile_range",
        "stage",
    )
    profile_range: torch.profiler.record_function
    # Set only with overlap_forward: the inputs and their version counters at the call,
    # and whether the search missed some (a write into one could not be seen).
    inputs: tuple[list[torch.Tensor], list[int]]
    blind: bool

    def __init__(
        self,
        stage: StageRuntime,
        module: nn.Module,
        ambient: Stream | None,
        events: list[Any],
    ) -> None:
        self.stage = stage
        self.module = module
        self.ambient = ambient
        self.events = events  # the stage's [fork, join] events on this thread
        # The exception being handled around the call, if any: the post-hook tells a
        # stage that raised from one called inside an ``except`` block by comparing.
        self.outer_exception = sys.exc_info()[1]


class RootCall:
    """One call of a wrapped model's root in flight on this thread."""

    __slots__ = (
        "bypass",
        "called",
        "first_pending",
        "module",
        "owner",
        "ran_inline",
        "used",
    )

    def __init__(self, owner: Scheduler, module: nn.Module) -> None:
        self.owner = owner
        self.module = module
        # Joins already pending on the thread (overlap_forward): not this call's to end.
        self.first_pending = _deferred.pending_count() if owner.overlap_forward else 0
        self.used: set[int] = set()  # stream indexes of the stages it ran
        self.called: set[StageRuntime] = set()  # the stages it ran on their streams
        self.ran_inline = False  # some stage call was bypassed (ran on the caller's stream)
        # Decided once for the whole call, at the root (cheaper than per stage call):
        # disabled(), tracing, and no_grad / inference_mode, which leave no backward to
        # overlap. A stage's own no_grad inside a training forward (reentrant checkpoint
        # runs its first forward so) still forks, as its recomputation will. With
        # overlap_forward, a no_grad forward has stages to overlap, so it forks too.
        self.bypass = eager_bypass_reason()
        if self.bypass is None and not torch.is_grad_enabled() and not owner.overlap_forward:
            self.bypass = "no_grad"


class ThreadState(threading.local):
    """What is in flight on one thread, for every wrapped model at once.

    Shared by all schedulers, so that the hooks of two wrapped models on one module (a
    stage module shared by both) can tell whose call it is: a stage hook acts only for the
    innermost root call in flight, or, outside any root call (e.g. a checkpoint
    recomputing a stage in backward), only if no other model already forked this call.
    """

    def __init__(self) -> None:
        self.frames: list[Frame] = []  # stage calls in flight, innermost last
        self.calls: list[RootCall] = []  # root calls in flight, innermost last
        # Each stage's [fork, join] events, made on first use and re-recorded on every call
        # after (creating an event costs a driver call). Per thread: each record is
        # followed at once by its wait, so within a thread a re-record never moves a
        # pending wait (a queued wait keeps the state it saw), but another thread's could.
        self.events: dict[StageRuntime, list[Any]] = {}
        self.unseen: list[str] = []  # type names tensors_in could not see into
        # Inside a checkpoint's unpack hook (it may recompute): the (backend, device) of
        # each stage call run there (recompute.py); None elsewhere.
        self.recomputing: list[tuple[Backend, torch.device]] | None = None


thread_state = ThreadState()
NO_EVENTS: list[Any] = []


class RootEvents(threading.local):
    """Per thread, one reused event per side stream for the root's final joins."""

    def __init__(self, streams: int) -> None:
        self.events: list[Any] = [None] * streams


def stage_depth() -> int:
    """Stage calls in flight on this thread: the level of code running now."""
    return len(thread_state.frames)


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
            stage.twin = twin
            paired = True
    return paired
