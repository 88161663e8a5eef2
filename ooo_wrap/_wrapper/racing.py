"""The hooks of the arm being timed while a model tunes (``tune.py``).

Each arm other than plain has a scheduler, made on its first step: while its arm runs,
its stage hooks are registered and its split layers swapped; at the next arm's first
step they come off again. The tuner's root hooks call the running arm's root hooks, so
a step pays for the hooks of its own arm only, and a plain step for none.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.utils.hooks import RemovableHandle

from .._events import EventLog
from .._runtime.accumulators import Accumulators
from .._runtime.backend import Backend, Stream
from .._runtime.scheduler import Scheduler
from .._runtime.variants import scheduler_class
from .._runtime.wgrad import WeightGradSplit
from .._stats import Counters
from .arms import Arm
from .split import plan_device

__all__ = ["ArmHooks", "Schedulers"]


@dataclass(eq=False)
class Schedulers:
    """Makes the scheduler of an arm (its split made, its layers not yet swapped); the
    side streams are made once and shared by every arm of a model."""

    backend: Backend
    log: EventLog
    counters: Counters
    accumulators: Accumulators
    profile_ranges: bool
    streams: list[Stream] = field(default_factory=list)

    def __call__(self, model: nn.Module, arm: Arm) -> Scheduler:
        backend, device = self.backend, plan_device(model, arm.plan)
        while len(self.streams) < arm.plan.num_streams:
            self.streams.append(backend.new_stream(device))
        # Picked here, once: the hooks carry no code for the options that are off.
        kind = scheduler_class(overlap_forward=arm.overlap, profile_ranges=self.profile_ranges)
        streams = self.streams[: arm.plan.num_streams]
        scheduler = kind(arm.plan, streams, backend, self.log, self.counters, device)
        scheduler.accumulators, scheduler.layout = self.accumulators, arm.name
        if arm.split:
            scheduler.weight_grads = WeightGradSplit(scheduler, backend, self.counters, self.log)
        return scheduler


class ArmHooks:
    """Put one arm's hooks on at a time (``switch``), for the model ``model`` (held
    weakly); ``make``: a new scheduler for an arm, its split (if any) made, not installed;
    ``layers``: the layers the split swaps."""

    def __init__(
        self,
        model: nn.Module,
        make: Callable[[nn.Module, Arm], Scheduler],
        layers: list[nn.Module],
    ) -> None:
        self._model = weakref.ref(model)
        self._make = make
        self._layers = layers
        self._schedulers: dict[str, Scheduler] = {}
        self.handles: list[RemovableHandle] = []  # the wrap state passes its own list
        self._on: Scheduler | None = None

    def switch(self, arm: Arm) -> Scheduler | None:
        """Take the running arm's hooks off and put ``arm``'s on; its scheduler (plain:
        ``None``)."""
        self._off()
        model = self._model()
        if arm.is_plain or model is None:
            return None
        scheduler = self._schedulers.get(arm.name)
        if scheduler is None:
            scheduler = self._schedulers[arm.name] = self._make(model, arm)
        scheduler.install_stages(model, self.handles)
        self._on = scheduler
        if scheduler.weight_grads is not None:
            scheduler.weight_grads.install(self._layers)
        return scheduler

    def close(self) -> None:
        """Every hook off, every scheduler let go."""
        self._off()
        for scheduler in self._schedulers.values():
            scheduler.release()
        self._schedulers.clear()

    def _off(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self._on is not None and self._on.weight_grads is not None:
            self._on.weight_grads.remove()
        self._on = None
