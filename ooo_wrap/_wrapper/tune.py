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
   the forward's tensors): a loop over a handful of sequence lengths compares the arms
   within each length (``tuning.py``). The first step of each arm at each shape is a
   warm-up.
3. Not counted: a step opened by a forward that raised or ran under ``disabled()`` or
   tracing. A forward with gradients off (evaluation) is left out of the step it falls
   in: marks before and after it cut its time out. Under a graph capture nothing is
   recorded (a capture cannot hold a timing event) and the open step is not counted;
   the graph holds the best-estimated candidate arm. Compiled forwards are not seen.
4. Racing: once every arm has ``tune_steps`` counted steps, an arm measured slower
   than plain (or not faster after ``MAX_ROUNDS`` times the steps) leaves the race; when
   none is left, plain is kept. Else the fastest arm faster than plain (on a tie the
   simpler) goes to a **confirmation round**: it alone against plain, on fresh steps, so
   that racing several noisy arms does not manufacture a win. It is kept only if faster
   there too. Step times are read, without a host sync, from marks the device has passed;
   the host waits once for the last mark when a round runs out of steps.
5. The decision is made in the root post-hook of a forward that returned and applied
   there by the wrap state (``lifecycle.py``): the tuner's hooks go, the winner's hooks
   are registered as a scheduled plan's are (plain: no hook at all).
6. One model is timed at a time in a process (``steps.py``): the others run their
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
from .._tensors import tensors_in
from .arms import Arm
from .shared import Shared
from .steps import StepBounds, Turns
from .tuning import MAX_ROUNDS, Stage, Tuning, compare, fastest, figures, timing

if TYPE_CHECKING:
    from .._runtime.roots import RootHooks

__all__ = ["Shape", "Switch", "Tuner", "shape_of"]

Shape = tuple[tuple[torch.Size, torch.dtype], ...]
# Put an arm's hooks on (and the previous arm's off); returns the scheduler whose root
# hooks the tuner calls, or None for plain.
Switch = Callable[[Arm], "RootHooks | None"]


@dataclass
class _Step:
    """One step being timed: its marks, and whether it counts (``arm`` is ``None`` if not)."""

    arm: Arm | None
    shape: Shape
    stage: Stage
    marks: list[Mark]  # start, then pairs cutting out evaluation forwards, then the end
    ms: float | None = None  # the time once read


@dataclass
class _Frame:
    """One root call the tuner acts for: a timed step, or an evaluation forward cut out."""

    module: nn.Module
    step: _Step | None  # None: an evaluation forward, its time cut out of the open step
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
        self._closed: list[_Step] = []  # finished counted steps
        self._opened = 0  # training forwards seen, counted or not
        self._open: _Step | None = None
        self._frames: list[_Frame] = []
        self._stage: Stage = "racing"
        self._confirming: Arm | None = None  # the race's winner, once confirming
        self._racing: list[Arm] = list(self.arms)  # plain first; arms measured slower leave
        self._opened_in_stage = 0
        self._rotation: dict[Shape, int] = {}
        self._warmed: set[tuple[str, Shape]] = set()
        self._synced: set[Stage] = set()
        self._capture_reported = False
        self.decision = "pending"  # what every rank keeps, once agreed
        self._verdict = "pending"  # what this rank found
        self.why = ""
        self.recalled = False  # decided from the cache (shared.py), or confirming its arm
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
        racing = [s for s in self._closed if s.stage == "racing"]
        arms = tuple(timing(arm, racing) for arm in self.arms)
        confirming = [s for s in self._closed if s.stage == "confirming"]
        pair = () if self._confirming is None else (self.arms[0], self._confirming)
        confirmation = tuple(timing(arm, confirming) for arm in pair)
        shapes = len({s.shape for s in self._closed if s.ms is not None})
        device = self.clock.device_name
        return Tuning(self.decision, arms, device, confirmation, shapes, self._stage, self.why)

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
            if self.active.is_plain and len(self.arms) > 1:
                self._activate(self.arms[1])  # the graph holds the best-estimated arm
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
                self._closed.append(step)
            if self._opened == 1:  # the first step told which optimizer updates the model
                self._recall(step.shape)
        self._opened += 1
        self._opened_in_stage += 1
        shape = shape_of(args, kwargs)
        arm: Arm | None = None
        if eligible and self._stage != "decided":
            turn = self._rotation.get(shape, 0)
            self._rotation[shape] = turn + 1
            arm = self._racing[turn % len(self._racing)]
            self._activate(arm)
            if (arm.name, shape) not in self._warmed:
                self._warmed.add((arm.name, shape))
                arm = None  # 2. its warm-up
        self._open = _Step(arm, shape, self._stage, [mark])
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
        if self._verdict == "pending":
            self._decide()
        agreed = self.shared.agree(self._opened, self._verdict, self.steps)
        if agreed not in ("pending", self._verdict):
            self.why = "rank 0's decision, taken by every rank"
        self.decision = agreed
        if agreed not in ("pending", self.shared.recalled):  # not the cache's own decision
            self.shared.store(self.record(), {s.shape for s in self._closed if s.arm})
        return agreed != "pending"

    def _activate(self, arm: Arm) -> None:
        if arm is not self.active:
            self.scheduler = self.switch(arm)
            self.active = arm

    # --- measuring and deciding -------------------------------------------------------

    def _decide(self) -> None:
        """4. Read what the device has passed; move on from racing or confirming."""
        stage = self._stage
        counted = [s for s in self._closed if s.stage == stage]
        per_arm = min(sum(s.arm is arm for s in counted) for arm in self._racing)
        # Also final after many forwards that mostly did not count (shapes never seen
        # twice, forwards that raise): the round ends, on what it could measure.
        limit = MAX_ROUNDS * self.steps
        final = per_arm >= limit or self._opened_in_stage >= 4 * limit * len(self._racing)
        if final and counted and stage not in self._synced:
            # The one host sync of a round: wait for the last mark of its last step.
            self._synced.add(stage)
            self.clock.synchronize(counted[-1].marks[-1])
        for step in counted:
            if step.ms is None and all(self.clock.done(mark) for mark in step.marks):
                step.ms = self._elapsed(step.marks)
        timings = {arm.name: timing(arm, counted) for arm in self._racing}
        plain = timings[self.arms[0].name].relative
        verdicts = {
            arm.name: compare(timings[arm.name].relative, plain, self.steps, final=final)
            for arm in self._racing[1:]
        }
        if stage == "confirming":
            (verdict,) = verdicts.values()
            if verdict == "pending":
                return
            winner, kept = self._racing[1], verdict == "faster"
            if self.recalled:  # the cache's arm, confirmed or not
                why = self.shared.confirmed_why(winner.name, figures(self.record()), kept=kept)
            elif kept:
                why = "faster than plain in the race and confirmed alone"
            else:
                why = f"{winner.name} was not faster when confirmed alone"
            return self._decided(winner if kept else self.arms[0], why)
        # Racing: arms measured slower than plain leave; the rest race on while unclear.
        if not final:
            self._racing = [arm for arm in self._racing if verdicts.get(arm.name) != "not_faster"]
            if len(self._racing) == 1:
                return self._decided(self.arms[0], "no arm was faster than plain")
            if any(v == "pending" for name, v in verdicts.items() if self._in_race(name)):
                return
        faster = [arm for arm in self._racing[1:] if verdicts[arm.name] == "faster"]
        if not faster:
            why = "no arm was faster than plain" if counted else "nothing could be timed"
            return self._decided(self.arms[0], why)
        self._confirm(fastest(faster, timings))

    def _in_race(self, name: str) -> bool:
        return any(arm.name == name for arm in self._racing)

    def _confirm(self, winner: Arm) -> None:
        """The winner alone against plain, on fresh steps."""
        self._stage, self._racing = "confirming", [self.arms[0], winner]
        self._confirming = winner
        self._opened_in_stage = 0
        self._rotation.clear()
        if self._open is not None:
            self._open.arm = None  # opened in the race

    def _decided(self, arm: Arm, why: str) -> None:
        self._verdict, self.why, self._stage = arm.name, why, "decided"

    def _recall(self, shape: Shape) -> None:
        """A decision the cache holds (``shared.py``), if any: it stands, or its arm (not
        plain) goes to the confirmation round (``tune_cache_confirm``)."""
        name = self.shared.recall(shape, self._bounds.optimizer)
        arm = next((arm for arm in self.arms if arm.name == name), None)
        if arm is None:
            return
        self.recalled = True
        if self.shared.confirm and not arm.is_plain:
            return self._confirm(arm)
        self._decided(arm, self.shared.cached_why())
        self._activate(arm)

    def _elapsed(self, marks: list[Mark]) -> float:
        """The step's time: start to end, less each evaluation forward cut out."""
        pairs = zip(marks[0::2], marks[1::2], strict=True)
        return sum(self.clock.elapsed_ms(start, end) for start, end in pairs)

    def _report_capture(self) -> None:
        if not self._capture_reported:  # the log keeps one event of a kind and reason
            self._capture_reported = True
            why = (
                f"a graph capture began before tuning decided: the graph holds the "
                f"{self.active.name} arm, unmeasured as a graph (eager step times do not "
                "apply to a replay); pin the arm to capture with tune_arm=..."
            )
            self.log.add(OOOEvent(EventKind.TUNED, "not_finished", why), level=logging.INFO)


def _lost_turn(holder: object) -> None:
    if isinstance(holder, Tuner) and holder._open is not None:
        holder._open.arm = None  # its open step held another model's work


def shape_of(args: Any, kwargs: Any) -> Shape:
    """The shapes and dtypes of a forward's input tensors, in order."""
    return tuple((t.shape, t.dtype) for t in tensors_in(args) + tensors_in(kwargs))
