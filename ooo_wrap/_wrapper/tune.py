"""Measured tuning: time plain and planned training steps on the device; keep the faster.

Once a plan is in force, two hooks on the model's root run a :class:`Tuner`:

1. A training step is one iteration of the user's loop. It starts at the first training
   forward after a step of *the model's optimizer*: the first ``torch.optim`` optimizer
   holding one of the model's parameters to step while it tunes (``torch.optim``'s global
   step hook tells). Steps of other optimizers (a GAN's discriminator's, between the
   generator's two forwards) do not end it. A model no optimizer updates (frozen) falls
   back to any optimizer's steps; a loop with no optimizer step, to every training
   forward. It records a timing mark on the caller's stream in the root pre-hook; the
   time from one mark to the next is the step (its forwards, backward, optimizer,
   whatever the loop does), credited to its arm. So gradient accumulation, a loss over
   two forwards or a GAN iteration is one step, in one arm; so is a checkpoint's
   recomputation of the whole model in backward (it stops early by raising through the
   model on purpose: not a forward that raised).
2. The arms alternate by step, plain then planned: in a plain step every stage call runs
   inline on the caller's stream (a ``BYPASSED``/``tuning`` stage call, as under
   ``ooo_wrap.disabled()``; a checkpoint's recomputation in that step's backward too), so
   the math is the same in both arms. The first step of each arm is a warm-up.
3. Not counted: a step opened by a forward that raised, ran under ``disabled()`` or
   tracing, or had other input shapes than the first tuned step. A forward with gradients
   off (evaluation) is left out of the step it falls in: marks before and after it cut its
   time out. Under a graph capture nothing is recorded (a capture cannot hold a timing
   event) and the open step is not counted; the graph holds the planned arm, its
   backward's checkpoint recomputations included. Compiled forwards are not seen.
4. After ``tune_steps`` counted steps per arm the step times are read, without a host
   sync, from the marks the device has passed. The plan is kept only if its median step
   beats the plain median by more than the noise (2 % and the larger arm's interquartile
   range over its median); plain wins when the plan is slower by as much. In between,
   more pairs run, up to three times ``tune_steps``; there the host waits once for the
   last mark (the one sync of a tuning) and plain wins unless the plan is clearly faster.
   If too few steps could be timed (input shapes that keep changing), the plan is kept,
   unmeasured, and the event says so.
5. The decision is made in the root post-hook of a forward that returned, after the
   scheduler's, and applied there by the wrap state (``lifecycle.py``): the tuner's hooks
   are removed (nothing is left on the hot path), and with plain the scheduler's too, as
   with ``no_parallelism``. The statistics are in ``tuning.py``.
6. One model tunes at a time in a process: a step of one model holds the work of every
   other model the loop runs, so while one tunes, the others run their plan and wait
   (a model that stops training for a while gives its turn away).
"""

from __future__ import annotations

import logging
import sys
import weakref
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from .._compat import is_checkpoint_early_stop
from .._events import EventKind, EventLog, OOOEvent
from .._reasons import Reason
from .._runtime.backend import Backend, Mark, StepClock
from .._runtime.inflight import RootCall, thread_state
from .._tensors import tensors_in
from .tuning import MAX_ROUNDS, Decision, Tuning, decide

if TYPE_CHECKING:
    from .._runtime.scheduler import Scheduler

__all__ = ["Tuner"]

Arm = Literal["plan", "plain"]
# Training forwards of other models after which a tuning model that ran none gives its
# turn away (it was trained for a while, then kept but no longer trained).
IDLE_FORWARDS = 8


@dataclass
class _Step:
    """One step being timed: its marks, and whether it counts (``arm`` is ``None`` if not)."""

    arm: Arm | None
    marks: list[Mark]  # start, then pairs cutting out evaluation forwards, then the end
    ms: float | None = None  # the time once read


@dataclass
class _Frame:
    """One root call the tuner acts for: a timed step, or an evaluation forward cut out."""

    module: nn.Module
    step: _Step | None  # None: an evaluation forward, its time cut out of the open step
    skipped: bool = field(default=False)  # nothing recorded (a capture, a nested call)
    plain: bool = False  # it runs every stage inline (the plain arm)
    # The exception being handled around the call, if any: one raised *by* the forward
    # is told apart from a forward called inside an ``except`` block by comparing.
    outer_exception: BaseException | None = field(default_factory=lambda: sys.exc_info()[1])


# A tuner's turn (6.): the one tuning now, and training forwards of others since its last.
_turn: weakref.ref[Tuner] | None = None
_idle = 0
# Optimizer steps run in the process (1.), counted by torch.optim's global step hook,
# which also tells each tuning model's tuner (held weakly) which optimizer stepped.
_optimizer_steps = 0
_optimizer_hook: RemovableHandle | None = None
_tuners: weakref.WeakSet[Tuner] = weakref.WeakSet()


def _count_optimizer_step(optimizer: Optimizer, args: object, kwargs: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    for tuner in tuple(_tuners):
        tuner.optimizer_stepped(optimizer)


def _watch_optimizer_steps(tuner: Tuner) -> None:
    """Tell ``tuner`` of optimizer steps from now on (one global hook per process)."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_count_optimizer_step)
    _tuners.add(tuner)


@dataclass(eq=False, repr=False)
class Tuner:
    """What the two root hooks of a tuning model do: time plain and planned steps, and say
    when the decision is made (the wrap state registers the hooks, after the scheduler's,
    and applies the decision). ``steps``: counted steps per arm before deciding;
    ``model``: the wrapped model (kept weakly), to tell which optimizer updates it."""

    scheduler: Scheduler
    backend: Backend
    log: EventLog
    device: torch.device
    clock: StepClock
    steps: int
    model: InitVar[nn.Module]

    def __post_init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._closed: list[_Step] = []  # finished counted steps
        self._opened = 0  # training forwards seen, counted or not
        self._open: _Step | None = None
        self._frames: list[_Frame] = []
        self._next_arm: Arm = "plain"
        self._frames_plain = False  # the open step runs plain
        self._warmed: set[Arm] = set()
        self._shapes: list[tuple[torch.Size, torch.dtype]] | None = None
        self._synced = False
        self._capture_reported = False
        # 1. The model's optimizer once one stepped, its steps, and those at the last mark.
        self._own_optimizer: weakref.ref[Optimizer] | None = None
        self._own_steps = 0
        self._own_steps_at_mark = 0
        _watch_optimizer_steps(self)
        self._optimizer_steps_at_start = _optimizer_steps
        self._optimizer_steps_at_mark = _optimizer_steps

        # The tuner's pre-hook releases the accumulators, once it has chosen the arm.
        self.scheduler.layout_by_tuner = True

    def close(self) -> None:
        """Its hooks are gone: give the turn away and leave the scheduler as it found it."""
        global _turn
        if _turn is not None and _turn() is self:
            _turn = None
        _tuners.discard(self)
        self.scheduler.bypass_outside_forward = None
        self.scheduler.layout_by_tuner = False

    def record(self, decision: Decision = "pending") -> Tuning:
        """The tuning so far (step times read only from marks the device has passed)."""
        plan = tuple(s.ms for s in self._closed if s.arm == "plan" and s.ms is not None)
        plain = tuple(s.ms for s in self._closed if s.arm == "plain" and s.ms is not None)
        return Tuning(decision, plan, plain, self.clock.device_name)

    # --- hooks ----------------------------------------------------------------------

    def pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """The root pre-hook (registered as is): choose the arm of this forward."""
        if torch.compiler.is_compiling():
            return
        calls = thread_state.calls
        if not calls or calls[-1].module is not module or calls[-1].owner is not self.scheduler:
            return  # the scheduler's pre-hook did not open this call
        call = calls[-1]
        self._choose_arm(module, call, args, kwargs)
        accumulators = self.scheduler.accumulators
        if accumulators is not None and call.bypass != "no_grad":
            # Still before any op of the forward, now that the arm is known: release the
            # accumulators the previous forward made if it ran on other streams.
            accumulators.begin(module, "inline" if call.bypass is not None else "planned")

    def _choose_arm(self, module: nn.Module, call: RootCall, args: Any, kwargs: Any) -> None:
        """1.-3.: time the step this forward starts or continues, and choose its arm."""
        calls = thread_state.calls
        if self._frames and not any(c.module is module for c in calls[:-1]):
            # Left by a forward a BaseException (KeyboardInterrupt) ended: its post-hook
            # never ran, so the open step's marks are incomplete.
            self._frames.clear()
            if self._open is not None:
                self._open.arm = None
        if self._frames:  # called inside its own forward: part of the step in flight
            if self._frames[0].plain:
                call.bypass = Reason.TUNING  # 2. inline as the whole plain step is
            self._frames.append(_Frame(module, None, skipped=True))
            return
        if thread_state.recomputing is not None:
            # 1. A checkpoint around the model recomputing it in backward: part of the
            # step whose forward it replays, in that step's arm; no mark.
            if self._frames_plain:
                call.bypass = Reason.TUNING
            self._frames.append(_Frame(module, None, skipped=True))
            return
        training = torch.is_grad_enabled()
        if training and not self._my_turn():
            self._run_planned()  # 6. another model is tuning: this one runs its plan, untimed
            return
        backend = self.backend
        stream = backend.current_stream(self.device)
        if backend.is_capturing(stream):
            # 3. No timing event in a capture: the open step cannot be timed. The graph
            # holds the planned arm, so its backward must recompute as planned too.
            if self._open is not None:
                self._open.arm = None
            self._run_planned()
            self._frames.append(_Frame(module, None, skipped=True))
            self._report_capture()
            return
        if not training:
            # 3. An evaluation forward: its marks cut it out of the open step.
            if self._open is not None:
                self._open.marks.append(self.clock.mark(stream))
            self._frames.append(_Frame(module, None))
            return
        step = self._open
        if step is not None and self._continues(step):
            # 1. Another forward of the step in flight: same arm, no mark.
            if not (call.bypass is None and self._same_shapes(args, kwargs)):
                step.arm = None
            plain = self._frames_plain
            if plain:
                call.bypass = Reason.TUNING
            self._frames.append(_Frame(module, step, plain=plain))
            return
        # 1. This mark ends the open step and starts a new one.
        mark = self.clock.mark(stream)
        self._optimizer_steps_at_mark = _optimizer_steps
        self._own_steps_at_mark = self._own_steps
        if step is not None:
            step.marks.append(mark)
            if step.arm is not None and len(step.marks) % 2 == 0:
                self._closed.append(step)
        self._opened += 1
        arm = self._arm_for(call.bypass is None and self._same_shapes(args, kwargs))
        plain = arm == "plain"
        if plain:
            call.bypass = Reason.TUNING  # 2. every stage call of this forward runs inline
        # 2. ...and a checkpoint's recomputation in this step's backward too.
        self.scheduler.bypass_outside_forward = Reason.TUNING if plain else None
        self._frames_plain = plain
        self._open = _Step(arm if arm in self._warmed else None, [mark])
        if arm is not None:
            self._warmed.add(arm)
        self._frames.append(_Frame(module, self._open, plain=plain))

    def post_hook(self, module: nn.Module) -> Decision:
        """The root post-hook: the decision, once made after a forward that returned (5.)."""
        if torch.compiler.is_compiling() or not self._frames:
            return "pending"
        if self._frames[-1].module is not module:
            return "pending"
        frame = self._frames.pop()
        if frame.skipped:
            return "pending"
        if frame.step is None:
            if self._open is not None:  # else no step is open to cut it out of
                stream = self.backend.current_stream(self.device)
                self._open.marks.append(self.clock.mark(stream))
            return "pending"
        error = sys.exc_info()[1]
        if error is not frame.outer_exception:
            # 3. A forward that raised counts nothing (a checkpoint's early stop is no
            # failure); and nothing is decided while its exception unwinds (torch then
            # runs the hooks from the live dict).
            if error is None or not is_checkpoint_early_stop(error):
                frame.step.arm = None
            return "pending"
        return self._decide()

    def optimizer_stepped(self, optimizer: Optimizer) -> None:
        """1. ``optimizer`` stepped: count it if it is the model's optimizer. The first to
        step holding one of the model's parameters becomes the model's (again if that one
        is freed: a loop that makes a new optimizer)."""
        if self._own_optimizer is None or self._own_optimizer() is None:
            model = self._model()
            ours = {id(param) for param in model.parameters()} if model is not None else set()
            groups = optimizer.param_groups
            if not any(id(param) in ours for group in groups for param in group["params"]):
                return
            self._own_optimizer = weakref.ref(optimizer)
        elif self._own_optimizer() is not optimizer:
            return
        self._own_steps += 1

    def _continues(self, step: _Step) -> bool:
        """Whether a training forward now belongs to ``step``: the model's optimizer has
        not stepped since its mark; or, while no optimizer updating the model is known, no
        optimizer at all, while the loop has run some (else every forward is a step)."""
        if self._own_optimizer is not None and self._own_optimizer() is not None:
            return self._own_steps == self._own_steps_at_mark
        stepped = _optimizer_steps != self._optimizer_steps_at_start
        return stepped and _optimizer_steps == self._optimizer_steps_at_mark

    def _run_planned(self) -> None:
        """This forward runs the plan, untimed: so does what its backward recomputes."""
        self.scheduler.bypass_outside_forward = None
        self._frames_plain = False

    def _my_turn(self) -> bool:
        """6. Whether this tuner may time this step: its turn, or a free or idle one."""
        global _turn, _idle
        holder = _turn() if _turn is not None else None
        if holder is self:
            _idle = 0
            return True
        if holder is None or _idle >= IDLE_FORWARDS:
            _turn, _idle = weakref.ref(self), 0
            if holder is not None and holder._open is not None:
                holder._open.arm = None  # its open step held this model's work
            return True
        _idle += 1
        return False

    # --- measuring and deciding -------------------------------------------------------

    def _arm_for(self, eligible: bool) -> Arm | None:
        """The next arm for an eligible forward (alternating), else ``None``."""
        if not eligible:
            return None
        arm = self._next_arm
        self._next_arm = "plan" if arm == "plain" else "plain"
        return arm

    def _same_shapes(self, args: Any, kwargs: Any) -> bool:
        shapes = [(t.shape, t.dtype) for t in tensors_in(args) + tensors_in(kwargs)]
        if self._shapes is None:
            self._shapes = shapes
        return shapes == self._shapes

    def _decide(self) -> Decision:
        counted = self._closed
        per_arm = min(sum(step.arm == arm for step in counted) for arm in ("plan", "plain"))
        # Also final after many forwards that mostly did not count (shapes that keep
        # changing, forwards that raise): tuning ends, on what it could measure.
        final = per_arm >= MAX_ROUNDS * self.steps or self._opened >= 4 * MAX_ROUNDS * self.steps
        if final and counted and not self._synced:
            # 4. The one host sync of a tuning: wait for the last mark of the last step.
            self._synced = True
            self.clock.synchronize(counted[-1].marks[-1])
        for step in counted:
            if step.ms is None and all(self.clock.done(mark) for mark in step.marks):
                step.ms = self._elapsed(step.marks)
        record = self.record()
        return decide(record.plan_ms, record.plain_ms, self.steps, final=final)

    def _elapsed(self, marks: list[Mark]) -> float:
        """The step's time: start to end, less each evaluation forward cut out."""
        pairs = zip(marks[0::2], marks[1::2], strict=True)
        return sum(self.clock.elapsed_ms(start, end) for start, end in pairs)

    def _report_capture(self) -> None:
        if self._capture_reported:
            return
        self._capture_reported = True
        self.log.add(
            OOOEvent(
                EventKind.TUNED,
                "not_finished",
                "a graph capture began before tuning decided, so the graph holds the planned "
                "arm; run eager training steps until model.tuning is decided before capturing "
                "(or wrap with tune=False)",
            ),
            level=logging.INFO,
        )
