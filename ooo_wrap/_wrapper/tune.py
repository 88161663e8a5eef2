"""Measured tuning: race the candidate arms on the device, keep the fastest, or plain.

While a model tunes, its root carries the tuner's two hooks only; the arm of each step
(``arms.py``: plain, stage regions, the weight-gradient split, both) is put on and taken
off at step boundaries by the wrap state (``switch``): its stage hooks and split layers,
while the tuner's root hooks call its scheduler's root hooks. So a step of one arm runs
only that arm's hooks, plain runs none, and once decided only the winner's remain.

1. A training step is one iteration of the user's loop, bounded by the model's own
   optimizer's steps (``steps.py``). A timing mark is recorded on the caller's stream in
   the root pre-hook as each step starts; the time to the next mark is the step (its
   forwards, backward, optimizer, whatever the loop does), credited to its arm. So
   gradient accumulation, a loss over two forwards, a GAN iteration, or a checkpoint's
   recomputation of the whole model in backward (it stops early by raising through the
   model on purpose: not a forward that raised) is part of one step, in one arm.
2. The arms rotate by step, separately for each input shape (the shapes and dtypes of
   the forward's tensors), and the race decides (``race.py``).
3. Not counted: a step opened by a forward that raised or ran under ``disabled()`` or
   tracing. A forward with gradients off (evaluation) is left out of the step it falls
   in: marks before and after it cut its time out. Under a graph capture nothing is
   recorded (a capture cannot hold a timing event) and the open step is not counted;
   the graph holds plain, unmeasured. ``graphed_step``, which owns its capture, races
   the arms as graphs instead (``hold``, ``replayed``;
   ``_integrations/graph_race.py``).
   Compiled forwards are not seen.
4. The decision is made in the root post-hook of a forward that returned and applied
   there by the wrap state (``lifecycle.py``): the tuner's hooks go, the winner's hooks
   are registered as a scheduled plan's are (plain: no hook at all).
5. One model is timed at a time in a process (``steps.py``): the others run their
   current arm, untimed.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._compat import is_checkpoint_early_stop, module_calls_on_stack
from .._events import EventKind, EventLog, OOOEvent
from .._runtime.accumulators import Accumulators
from .._runtime.backend import Backend, Mark, StepClock
from .._runtime.bypass import eager_bypass_reason
from .._runtime.inflight import thread_state
from .arms import Arm
from .race import Race
from .shared import Shared
from .steps import StepBounds, Turns
from .tuning import Shape, TimedStep, Tuning, figures, shape_of

if TYPE_CHECKING:
    from .._runtime.roots import RootHooks

__all__ = ["Switch", "Tuner"]

# Put an arm's hooks on (and the previous arm's off); returns the scheduler whose root
# hooks the tuner calls, or None for plain.
Switch = Callable[[Arm], "RootHooks | None"]


@dataclass
class _Frame:
    """One root call the tuner acts for: a timed step, or an evaluation forward cut out."""

    module: nn.Module
    step: TimedStep | None  # None: an evaluation forward, its time cut out of the open step
    scheduler: RootHooks | None  # whose root hooks opened the call (None: plain)
    skipped: bool = field(default=False)  # nothing recorded (a capture, a nested call)
    # The exception being handled around the call, if any: one raised *by* the forward
    # is told apart from a forward called inside an ``except`` block by comparing.
    outer_exception: BaseException | None = field(default_factory=lambda: sys.exc_info()[1])


@dataclass(eq=False, repr=False)
class Tuner:
    """What the two root hooks of a tuning model do: race ``arms`` (plain first) and say
    when the decision is made (the wrap state registers the hooks, puts each arm's hooks
    on through ``switch`` and applies the decision). ``steps``: counted steps per arm
    per round; ``model``: the wrapped model (kept weakly), to tell which optimizer
    updates it."""

    arms: Sequence[Arm]
    switch: Switch
    backend: Backend
    log: EventLog
    device: torch.device
    clock: StepClock
    steps: int
    accumulators: Accumulators
    shared: Shared  # the cache, and the other ranks
    model: InitVar[nn.Module]

    def __post_init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self.race = Race(self.arms, self.steps, self.clock)  # 2.
        self._opened = 0  # training forwards seen, counted or not
        self._open: TimedStep | None = None
        self._frames: list[_Frame] = []
        self._capture_reported = False
        self.decision = "pending"  # what every rank keeps, once agreed
        self.recalled = False  # decided from the cache (shared.py), or confirming its arm
        self.held = False  # graphed_step holds the arm (hold)
        self.as_graph = False  # the steps timed are graph replays (replayed)
        self.active: Arm = self.arms[0]
        self.scheduler: RootHooks | None = None
        self._bounds = StepBounds(model)  # 1.

    in_forward = property(lambda self: bool(self._frames))  # a forward of the model runs

    def close(self) -> None:
        """Its hooks are gone: give the turn away."""
        Turns.give_back(self)
        self._bounds.close()

    def record(self) -> Tuning:
        """The tuning so far (step times read only from marks the device has passed)."""
        return self.race.record(self.decision, self.as_graph)

    # --- hooks ----------------------------------------------------------------------

    def pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """The root pre-hook (registered as is): choose the arm, then open the call as
        that arm's scheduler does."""
        scheduler = self.scheduler
        if not torch.compiler.is_compiling():
            scheduler = self._choose_arm(module, args, kwargs)
        if scheduler is not None:
            scheduler._root_pre_hook(module, args, kwargs)
        elif not torch.compiler.is_compiling():
            if torch.is_grad_enabled() and eager_bypass_reason() is None:
                self.accumulators.begin(module, "inline")
            else:
                self.accumulators.enter()

    def _choose_arm(self, module: nn.Module, args: Any, kwargs: Any) -> RootHooks | None:
        """1.-3.: time the step this forward starts or continues, and choose its arm;
        the scheduler of the arm that runs it."""
        if self._frames and module_calls_on_stack()[id(module)] <= len(self._frames):
            # Left by a forward a BaseException (KeyboardInterrupt) ended: its post-hook
            # never ran, so the open step's marks are incomplete. (The calls running
            # include this one, whose frame is not pushed yet.)
            self._frames.clear()
            if self._open is not None:
                self._open.arm = None
        if self.held:
            # graphed_step holds the arm (it races the arms as graphs): nothing is timed.
            self._frames.append(_Frame(module, None, self.scheduler, skipped=True))
            return self.scheduler
        if self._frames or thread_state.recomputing is not None:
            # Called inside its own forward, or a checkpoint around the model recomputing
            # it in backward: part of the step in flight, in its arm; no mark.
            self._frames.append(_Frame(module, None, self.scheduler, skipped=True))
            return self.scheduler
        training = torch.is_grad_enabled()
        if training and not Turns.mine(self, _lost_turn):
            return self.scheduler  # 6. another model is tuning: this arm runs, untimed
        stream = self.backend.current_stream(self.device)
        if self.backend.is_capturing(stream):
            # 3. No timing event in a capture: the open step cannot be timed.
            if self._open is not None:
                self._open.arm = None
            self._activate(self.arms[0])  # unmeasured as a graph: plain
            self._frames.append(_Frame(module, None, self.scheduler, skipped=True))
            self._report_capture()
            return self.scheduler
        if not training:
            # 3. An evaluation forward: its marks cut it out of the open step.
            if self._open is not None:
                self._open.marks.append(self.clock.mark(stream))
            self._frames.append(_Frame(module, None, self.scheduler))
            return self.scheduler
        eligible = eager_bypass_reason() is None
        step = self._open
        if step is not None and self._bounds.continues():
            # 1. Another forward of the step in flight: same arm, no mark.
            if not eligible:
                step.arm = None
            self._frames.append(_Frame(module, step, self.scheduler))
            return self.scheduler
        # 1. This mark ends the open step and starts a new one.
        mark = self.clock.mark(stream)
        self._bounds.marked()
        if step is not None:
            step.marks.append(mark)
            if step.arm is not None and len(step.marks) % 2 == 0:
                self.race.count(step)
            if self._opened == 1:  # the first step told which optimizer updates the model
                self._recall(step.shape)
        self._opened += 1
        shape = shape_of(args, kwargs)
        arm: Arm | None = None
        if eligible and self.race.stage != "decided":
            arm, warmed = self.race.next_turn(shape)
            self._activate(arm)
            arm = arm if warmed else None  # 2. else its warm-up
        else:
            self.race.begun()
        self._open = TimedStep(arm, shape, self.race.stage, [mark])
        self._frames.append(_Frame(module, self._open, self.scheduler))
        return self.scheduler

    def post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> bool:
        """The root post-hook: close the call as its scheduler does; whether the decision
        was made now (5.), after a forward that returned."""
        frame = self._frames[-1] if self._frames else None
        if frame is not None and frame.module is not module:
            frame = None
        scheduler = self.scheduler if frame is None else frame.scheduler
        if scheduler is not None:
            scheduler._root_post_hook(module, args, kwargs, output)
        elif not torch.compiler.is_compiling():
            self.accumulators.end(module)
        if torch.compiler.is_compiling() or frame is None:
            return False
        self._frames.pop()
        if frame.skipped:
            return False
        if frame.step is None:
            if self._open is not None:  # else no step is open to cut it out of
                stream = self.backend.current_stream(self.device)
                self._open.marks.append(self.clock.mark(stream))
            return False
        error = sys.exc_info()[1]
        if error is not frame.outer_exception:
            # 3. A forward that raised counts nothing (a checkpoint's early stop is no
            # failure); and nothing is decided while its exception unwinds (torch then
            # runs the hooks from the live dict).
            if error is None or not is_checkpoint_early_stop(error):
                frame.step.arm = None
            return False
        return self._agreed(store=True)

    def _agreed(self, *, store: bool) -> bool:
        """Decide if the evidence allows, agree with the other ranks; whether decided."""
        race = self.race
        if race.verdict == "pending":
            stage = race.stage
            race.decide()
            if race.stage == "confirming" != stage and self._open is not None:
                self._open.arm = None  # opened in the race
        agreed = self.shared.agree(self._opened, race.verdict, self.steps)
        if agreed not in ("pending", race.verdict):
            race.why = "rank 0's decision, taken by every rank"
        self.decision = agreed
        if store and agreed not in ("pending", self.shared.recalled):  # not the cache's own
            self.shared.store(self.record(), race.shapes())
        return agreed != "pending"

    # --- racing as graphs (graphed_step) ----------------------------------------------

    def hold(self, arm: Arm | None) -> None:
        """``graphed_step`` races the arms as CUDA graphs: from now on forwards run ``arm``
        and nothing is timed or switched by them (``None``: let go). The open step, if
        any, is not counted. Letting go of a tuner not held changes nothing."""
        if arm is None and not self.held:
            return
        if self._open is not None:
            self._open.arm = None
        self.held = arm is not None
        if arm is not None:
            self._activate(arm)
        elif self.as_graph and self.decision == "pending":
            # Let go undecided: eager steps race again, from the start.
            self.as_graph = False
            self.race = Race(self.arms, self.steps, self.clock)

    def race_as_graphs(self) -> None:
        """From now on the steps timed are graph replays: a race of eager steps so far is
        dropped (their times do not apply to a replay)."""
        if not self.as_graph:
            self.as_graph = True
            self.race = Race(self.arms, self.steps, self.clock)
            self.recalled = False  # a cached arm being confirmed is raced again as a graph
            self.shared.recalled = None

    def replayed(self, arm: Arm | None, shape: Shape, start: Mark, end: Mark) -> bool:
        """A replay of ``arm``'s graph (``None``: a warm-up) at ``shape`` ran between the
        marks; whether the race is decided now. Not cached: the cache holds eager steps."""
        self._opened += 1
        if arm is not None:
            self.race.count(TimedStep(arm, shape, self.race.stage, [start, end]))
        return self._agreed(store=False)

    def _activate(self, arm: Arm) -> None:
        if arm is not self.active:
            self.scheduler = self.switch(arm)
            self.active = arm

    # --- measuring and deciding -------------------------------------------------------

    def _recall(self, shape: Shape) -> None:
        """A decision the cache holds (``shared.py``), if any: it stands, or its arm (not
        plain) goes to the confirmation round (``tune_cache_confirm``)."""
        name = self.shared.recall(shape, self._bounds.optimizer)
        arm = next((arm for arm in self.arms if arm.name == name), None)
        if arm is None:
            return
        self.recalled = True
        if self.shared.confirm and not arm.is_plain:
            self.race.explain = lambda winner, kept: self.shared.confirmed_why(
                winner, figures(self.record()), kept=kept
            )
            return self.race.confirm(arm)
        self.race.decided(arm, self.shared.cached_why())
        self._activate(arm)

    def _report_capture(self) -> None:
        if not self._capture_reported:  # the log keeps one event of a kind and reason
            self._capture_reported = True
            why = (
                "a graph capture began before tuning decided: the graph holds plain, "
                "unmeasured as a graph (eager step times do not apply to a replay); "
                "ooo_wrap.graphed_step races the arms as graphs, or pin one with tune_arm=..."
            )
            self.log.add(OOOEvent(EventKind.TUNED, "not_finished", why), level=logging.INFO)


def _lost_turn(holder: object) -> None:
    if isinstance(holder, Tuner) and holder._open is not None:
        holder._open.arm = None  # its open step held another model's work
