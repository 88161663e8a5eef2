"""Measured tuning: time plain and planned training steps on the device; keep the faster.

Once a plan is in force, a :class:`Tuner` adds two hooks to the model's root:

1. A training step starts at a training forward: the first one after an optimizer step
   (``torch.optim``'s global step hook counts them), or every training forward in a loop
   that has run no optimizer step since tuning began. It records a timing mark on the
   caller's stream in the root pre-hook; the time from one mark to the next is the step
   (its forwards, backward, optimizer, whatever the loop does), credited to its arm. So
   gradient accumulation or a loss over two forwards is one step, in one arm.
2. The arms alternate by step, plain then planned: in a plain step every stage call runs
   inline on the caller's stream (a ``BYPASSED``/``tuning`` stage call, as under
   ``ooo_wrap.disabled()``; a checkpoint's recomputation in that step's backward too), so
   the math is the same in both arms. The first step of each arm is a warm-up.
3. Not counted: a step opened by a forward that raised, ran under ``disabled()`` or
   tracing, or had other input shapes than the first tuned step. A forward with gradients
   off (evaluation) is left out of the step it falls in: marks before and after it cut its
   time out. Under a graph capture nothing is recorded (a capture cannot hold a timing
   event) and the open step is not counted. Compiled forwards are not seen.
4. After ``tune_steps`` counted steps per arm the step times are read, without a host
   sync, from the marks the device has passed. The plan is kept only if its median step
   beats the plain median by more than the noise (2 % and the larger arm's interquartile
   range over its median); plain wins when the plan is slower by as much. In between,
   more pairs run, up to three times ``tune_steps``; there the host waits once for the
   last mark (the one sync of a tuning) and plain wins unless the plan is clearly faster.
   If too few steps could be timed (input shapes that keep changing), the plan is kept,
   unmeasured, and the event says so.
5. The decision is applied in the root post-hook of a forward that returned, after the
   scheduler's: the tuner's hooks are removed (nothing is left on the hot path), and with
   plain the scheduler's too, as with ``no_parallelism``.
6. One model tunes at a time in a process: a step of one model holds the work of every
   other model the loop runs, so while one tunes, the others run their plan and wait
   (a model that stops training for a while gives its turn away).
"""

from __future__ import annotations

import logging
import statistics
import sys
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from .._events import EventKind, OOOEvent
from .._runtime.backend import Mark, StepClock
from .._runtime.inflight import RootCall, thread_state
from .._tensors import tensors_in
from .handles import remove_part

if TYPE_CHECKING:
    from .._runtime.scheduler import Scheduler
    from .module import _WrapState

__all__ = ["MIN_GAIN", "Decision", "Tuner", "Tuning", "decide"]

Decision = Literal["pending", "plan", "plain"]
Arm = Literal["plan", "plain"]

# The smallest gain worth side streams: below it, run-to-run noise on a busy host and the
# risk of a worse step on another batch outweigh it.
MIN_GAIN = 0.02
# How many times tune_steps pairs may run while the evidence is unclear.
MAX_ROUNDS = 3
# Training forwards of other models after which a tuning model that ran none gives its
# turn away (it was trained for a while, then kept but no longer trained).
IDLE_FORWARDS = 8


@dataclass(frozen=True)
class Tuning:
    """What measured tuning found for one wrapped model (``model.tuning``).

    Attributes:
        decision: ``"pending"`` while measuring, ``"plan"`` if the plan was kept,
            ``"plain"`` if the plain model was faster or not clearly slower.
        plan_ms: the counted step times with the plan, in milliseconds, in order.
        plain_ms: the counted step times of the plain model.
        device: the name of the device the steps were timed on.
    """

    decision: Decision
    plan_ms: tuple[float, ...]
    plain_ms: tuple[float, ...]
    device: str

    @property
    def plan_median_ms(self) -> float | None:
        """The median planned step, or ``None`` before one was counted."""
        return statistics.median(self.plan_ms) if self.plan_ms else None

    @property
    def plain_median_ms(self) -> float | None:
        """The median plain step, or ``None`` before one was counted."""
        return statistics.median(self.plain_ms) if self.plain_ms else None

    @property
    def speedup(self) -> float | None:
        """Plain median over planned median (above 1: the plan is faster)."""
        plan, plain = self.plan_median_ms, self.plain_median_ms
        return plain / plan if plan and plain is not None else None

    def __str__(self) -> str:
        counts = f"{len(self.plan_ms)} planned and {len(self.plain_ms)} plain steps"
        if self.decision == "pending":
            return f"tuning on {self.device}: pending ({counts} measured so far)"
        verdict = "plan kept" if self.decision == "plan" else "plain model kept"
        if self.speedup is None:
            return f"tuning on {self.device}: {verdict}, unmeasured ({counts}: too few)"
        return (
            f"tuning on {self.device}: {verdict}, {self.speedup:.2f}x: median step "
            f"{self.plan_median_ms:.3f} ms planned vs {self.plain_median_ms:.3f} ms plain "
            f"({counts}, measured)"
        )


def decide(
    plan_ms: tuple[float, ...], plain_ms: tuple[float, ...], steps: int, *, final: bool
) -> Decision:
    """The decision for these step times; ``final`` when no more pairs may run."""
    if not final and min(len(plan_ms), len(plain_ms)) < steps:
        return "pending"
    if len(plan_ms) < 2 or len(plain_ms) < 2:
        return "plan"  # nothing measured against the plan: it stands, said unmeasured
    plan, plain = statistics.median(plan_ms), statistics.median(plain_ms)
    margin = max(MIN_GAIN, _spread(plan_ms), _spread(plain_ms))
    if plan < plain * (1 - margin):
        return "plan"
    if final or plan > plain * (1 + margin):
        return "plain"
    return "pending"


def _spread(times: tuple[float, ...]) -> float:
    """Interquartile range over the median."""
    quartiles = statistics.quantiles(times, n=4)
    return (quartiles[2] - quartiles[0]) / quartiles[1] if quartiles[1] > 0 else float("inf")


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
# Optimizer steps run in the process (1.), counted by torch.optim's global step hook.
_optimizer_steps = 0
_optimizer_hook: RemovableHandle | None = None


def _count_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizer_steps() -> None:
    """Count optimizer steps from now on (once per process; a counter, nothing else)."""
    global _optimizer_hook
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_post_hook(_count_optimizer_step)


class Tuner:
    """The two root hooks that time plain and planned steps and apply the decision."""

    def __init__(
        self,
        state: _WrapState,
        scheduler: Scheduler,
        device: torch.device,
        clock: StepClock,
        steps: int,
    ) -> None:
        self._state = state
        self._scheduler = scheduler
        self._device = device
        self._clock = clock
        self._steps = steps
        self._handles: list[RemovableHandle] = []
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
        _watch_optimizer_steps()
        self._optimizer_steps_at_start = _optimizer_steps
        self._optimizer_steps_at_mark = _optimizer_steps

    def install(self, model: nn.Module) -> None:
        """Register the hooks after the scheduler's, so the root call is there to read."""
        self._scheduler.layout_by_tuner = True
        for handle in (
            model.register_forward_pre_hook(self._pre_hook, with_kwargs=True),
            model.register_forward_hook(self._post_hook, with_kwargs=True, always_call=True),
        ):
            self._handles.append(handle)
            self._state.handles.append(handle)

    def remove(self) -> None:
        """Remove the tuner's hooks (and their handles from the wrap state); give the turn."""
        global _turn
        if _turn is not None and _turn() is self:
            _turn = None
        self._scheduler.bypass_outside_forward = None
        self._scheduler.layout_by_tuner = False
        remove_part(self._handles, self._state.handles)

    def record(self, decision: Decision = "pending") -> Tuning:
        """The tuning so far (step times read only from marks the device has passed)."""
        plan = tuple(s.ms for s in self._closed if s.arm == "plan" and s.ms is not None)
        plain = tuple(s.ms for s in self._closed if s.arm == "plain" and s.ms is not None)
        return Tuning(decision, plan, plain, self._clock.device_name)

    # --- hooks ----------------------------------------------------------------------

    def _pre_hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        calls = thread_state.calls
        if not calls or calls[-1].module is not module or calls[-1].owner is not self._scheduler:
            return  # the scheduler's pre-hook did not open this call
        call = calls[-1]
        self._choose_arm(module, call, args, kwargs)
        accumulators = self._scheduler.accumulators
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
                call.bypass = "tuning"  # 2. inline as the whole plain step is
            self._frames.append(_Frame(module, None, skipped=True))
            return
        training = torch.is_grad_enabled()
        if training and not self._my_turn():
            return  # 6. another model is tuning: this one runs its plan, untimed
        backend = self._state.backend
        stream = backend.current_stream(self._device)
        if backend.is_capturing(stream):
            # 3. No timing event in a capture: the open step cannot be timed.
            if self._open is not None:
                self._open.arm = None
            self._frames.append(_Frame(module, None, skipped=True))
            self._report_capture()
            return
        if not training:
            # 3. An evaluation forward: its marks cut it out of the open step.
            if self._open is not None:
                self._open.marks.append(self._clock.mark(stream))
            self._frames.append(_Frame(module, None))
            return
        step = self._open
        if step is not None and self._continues(step):
            # 1. Another forward of the step in flight: same arm, no mark.
            if not (call.bypass is None and self._same_shapes(args, kwargs)):
                step.arm = None
            plain = self._frames_plain
            if plain:
                call.bypass = "tuning"
            self._frames.append(_Frame(module, step, plain=plain))
            return
        # 1. This mark ends the open step and starts a new one.
        mark = self._clock.mark(stream)
        self._optimizer_steps_at_mark = _optimizer_steps
        if step is not None:
            step.marks.append(mark)
            if step.arm is not None and len(step.marks) % 2 == 0:
                self._closed.append(step)
        self._opened += 1
        arm = self._arm_for(call.bypass is None and self._same_shapes(args, kwargs))
        plain = arm == "plain"
        if plain:
            call.bypass = "tuning"  # 2. every stage call of this forward runs inline
        # 2. ...and a checkpoint's recomputation in this step's backward too.
        self._scheduler.bypass_outside_forward = "tuning" if plain else None
        self._frames_plain = plain
        self._open = _Step(arm if arm in self._warmed else None, [mark])
        if arm is not None:
            self._warmed.add(arm)
        self._frames.append(_Frame(module, self._open, plain=plain))

    def _post_hook(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._frames:
            return
        if self._frames[-1].module is not module:
            return
        frame = self._frames.pop()
        if frame.skipped:
            return
        if frame.step is None:
            if self._open is not None:  # else no step is open to cut it out of
                stream = self._state.backend.current_stream(self._device)
                self._open.marks.append(self._clock.mark(stream))
            return
        if sys.exc_info()[1] is not frame.outer_exception:
            # 3. A forward that raised counts nothing; and nothing is decided while its
            # exception unwinds (torch then runs the hooks from the live dict).
            frame.step.arm = None
            return
        decision = self._decide()
        if decision != "pending":
            self._apply(module, decision)

    def _continues(self, step: _Step) -> bool:
        """Whether a training forward now belongs to ``step``: no optimizer step ran since
        its mark, while the loop has run optimizer steps (so steps are bounded by them)."""
        stepped = _optimizer_steps != self._optimizer_steps_at_start
        return stepped and _optimizer_steps == self._optimizer_steps_at_mark

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
        final = per_arm >= MAX_ROUNDS * self._steps or self._opened >= 4 * MAX_ROUNDS * self._steps
        if final and counted and not self._synced:
            # 4. The one host sync of a tuning: wait for the last mark of the last step.
            self._synced = True
            self._clock.synchronize(counted[-1].marks[-1])
        for step in counted:
            if step.ms is None and all(self._clock.done(mark) for mark in step.marks):
                step.ms = self._elapsed(step.marks)
        record = self.record()
        return decide(record.plan_ms, record.plain_ms, self._steps, final=final)

    def _elapsed(self, marks: list[Mark]) -> float:
        """The step's time: start to end, less each evaluation forward cut out."""
        pairs = zip(marks[0::2], marks[1::2], strict=True)
        return sum(self._clock.elapsed_ms(start, end) for start, end in pairs)

    def _apply(self, module: nn.Module, decision: Decision) -> None:
        """5. Remove the tuner's hooks; with plain, the scheduler's too."""
        state = self._state
        record = self.record(decision)
        state.tuning, state.tuner = record, None
        self.remove()
        if record.speedup is None:
            state.log.add(
                OOOEvent(
                    EventKind.TUNED,
                    "unmeasured",
                    f"too few steps could be timed on {record.device} ({len(record.plan_ms)} "
                    f"planned, {len(record.plain_ms)} plain: input shapes kept changing, or "
                    "forwards raised): the plan is kept, unmeasured; model.retune() "
                    "measures again",
                ),
                level=logging.INFO,
            )
            return
        figures = (
            f"median step {record.plan_median_ms:.3f} ms with the plan vs "
            f"{record.plain_median_ms:.3f} ms plain ({record.speedup:.2f}x, "
            f"{len(record.plan_ms)} and {len(record.plain_ms)} steps measured on "
            f"{record.device})"
        )
        if decision == "plan":
            state.log.add(
                OOOEvent(EventKind.TUNED, "kept", f"{figures}: the plan is kept"),
                level=logging.INFO,
            )
            return
        state.stop(
            "measured_slower",
            f"{figures}: the plan was not measurably faster than the plain model",
        )

    def stop_for_graphs(self) -> None:
        """The forward replays a CUDA graph from now on (``make_graphed_callables``): its
        steps are all the captured plan, so tuning stops undecided."""
        state = self._state
        state.tuning, state.tuner = self.record(), None
        self.remove()
        state.log.add(
            OOOEvent(
                EventKind.TUNED,
                "not_finished",
                "the forward replays a CUDA graph now, which holds the plan: tuning stopped "
                "before it decided; tune with eager steps first, or wrap with tune=False",
            ),
            level=logging.INFO,
        )

    def _report_capture(self) -> None:
        if self._capture_reported:
            return
        self._capture_reported = True
        self._state.log.add(
            OOOEvent(
                EventKind.TUNED,
                "not_finished",
                "a graph capture began before tuning decided, so the graph holds the planned "
                "arm; run eager training steps until model.tuning is decided before capturing "
                "(or wrap with tune=False)",
            ),
            level=logging.INFO,
        )
