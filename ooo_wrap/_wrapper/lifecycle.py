"""The wrap state machine: what the wrapper holds for one wrapped model, and every change.

A wrapped model is always in one :class:`Phase`, and only the transitions here add or
remove the wrapper's hooks (``_remove`` is the one place they come off):

- ``LEARNING``: the learner's root hooks (``dataflow``) until the first eligible training
  forward returns; its plan moves the model to ``SCHEDULED`` (then ``TUNING``), or to
  ``STOPPED`` when there is nothing to overlap or the plan cannot start.
- ``SCHEDULED``: the scheduler's hooks (the stages' and the root's), and the split layers'
  swapped classes where the plan runs with the weight-gradient split (``split.py``).
- ``TUNING``: the scheduler's and the tuner's hooks, until ``SCHEDULED`` (plan kept, or a
  CUDA graph replays the forward: undecided) or ``STOPPED`` (``measured_slower``).
- ``STOPPED``: no hook at all: the model runs plain, still wrapped. ``UNWRAPPED``: final.

From outside: ``replan()`` moves any other phase to ``LEARNING``; ``retune()`` moves
``SCHEDULED`` to ``TUNING`` and ``STOPPED`` (with a plan) back to the plan's hooks;
``unwrap()`` moves any phase to ``UNWRAPPED``. Those three are refused inside a forward of
the model and change nothing then. A transition that adds hooks and fails removes what it
added and leaves the phase as it was before them (``replan()`` has taken the old hooks off
by then, so a failure there leaves the model ``STOPPED``, running plain). A wrap state
never refers to its model (the hooks are passed it), so the registry keyed weakly by the
model keeps nothing alive.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._errors import OOOConfigError, OOOError
from .._events import EventKind, EventLog, OOOEvent
from .._plan import Plan
from .._planner.learned_plan import learned_of
from .._reasons import Reason
from .._runtime.accumulators import Accumulators
from .._runtime.backend import Backend, clock_of
from .._runtime.scheduler import Scheduler, running
from .._runtime.variants import scheduler_class
from .._stats import Counters
from .learn import Learned, Learner, learned_events, pending_plan, removed_before_learning
from .options import WrapOptions
from .split import devices, plan_device, split_alone, split_wanted, start_split
from .tune import Tuner
from .tuning import Tuning, slower_why, tuned_event

__all__ = ["Phase", "WrapState", "devices"]


class Phase(enum.Enum):
    """Which hooks of the wrapper a wrapped model carries (see the module docstring)."""

    LEARNING = "learning"
    SCHEDULED = "scheduled"
    TUNING = "tuning"
    STOPPED = "stopped"
    UNWRAPPED = "unwrapped"


Part = Literal["learner", "scheduler", "tuner"]
# The parts whose hooks each phase carries (installed, and listed in handles, in _ALL order).
_PARTS: dict[Phase, tuple[Part, ...]] = {
    Phase.LEARNING: ("learner",),
    Phase.SCHEDULED: ("scheduler",),
    Phase.TUNING: ("scheduler", "tuner"),
    Phase.STOPPED: (),
    Phase.UNWRAPPED: (),
}
_ALL: tuple[Part, ...] = ("learner", "scheduler", "tuner")


@dataclass(kw_only=True, eq=False)
class WrapState:
    """Everything the wrapper knows about one wrapped model (kept outside the model).

    Made with no hooks (``STOPPED``); :meth:`start` puts the first ones on.
    """

    plan: Plan
    options: WrapOptions
    original_class: type[nn.Module]
    backend: Backend
    log: EventLog = field(default_factory=EventLog)
    counters: Counters = field(default_factory=Counters)
    # Which accumulators the wrapper's own forwards made (released when the next forward
    # runs on other streams; _runtime/accumulators.py).
    accumulators: Accumulators = field(default_factory=Accumulators)
    phase: Phase = field(default=Phase.STOPPED, init=False)
    # The object behind each part's hooks, while the phase has that part.
    learner: Learner | None = field(default=None, init=False)
    scheduler: Scheduler | None = field(default=None, init=False)
    tuner: Tuner | None = field(default=None, init=False)
    # The last tuning, as far as it got; None if it never tuned.
    decided: Tuning | None = field(default=None, init=False)
    _hooks: dict[Part, list[RemovableHandle]] = field(
        default_factory=lambda: {part: [] for part in _ALL}, init=False
    )

    @property
    def handles(self) -> list[RemovableHandle]:
        """Every hook of the wrapper on the model, in install order (a new list)."""
        return [handle for part in _ALL for handle in self._hooks[part]]

    def events(self) -> tuple[OOOEvent, ...]:
        if self.scheduler is not None:
            self.scheduler.sync_compiled_events()
        if self.learner is not None and (event := self.learner.compiled_event()) is not None:
            self.log.add(event, level=logging.INFO)  # noted inside compiled code, logged here
        return self.log.snapshot()

    def tuning(self) -> Tuning | None:
        """``model.tuning``: the tuning underway, else the last one."""
        return self.tuner.record() if self.tuner is not None else self.decided

    # --- transitions from outside -------------------------------------------------------

    def start(self, model: nn.Module, learn_on: torch.device | None) -> None:
        """The first hooks: the learner's, learning on ``learn_on``, else the plan's."""
        if learn_on is None:
            self._schedule(model, self.plan)
        else:
            self._learn(model, learn_on)

    def replan(self, model: nn.Module) -> None:
        """Learn the plan again on the next training forward (-> ``LEARNING``)."""
        if self.options.planner != "dataflow":
            raise OOOConfigError(
                "replan() learns the plan from the dataflow, but this model was wrapped with "
                "planner='static'; unwrap it and wrap it again with planner='dataflow'"
            )
        self._refuse_inside_forward(model, "replan()")
        if self.phase is Phase.LEARNING:
            return  # not learned yet: the next training forward learns it anyway
        device = self.plan.devices[0] if self.plan.stages else devices(model)[0]
        self._remove(*_ALL)
        self.phase = Phase.STOPPED
        self._learn(model, device)
        self.log.add(
            OOOEvent(EventKind.PLANNED, "replan", "the plan is learned again on the next forward"),
            level=logging.INFO,
        )

    def retune(self, model: nn.Module) -> None:
        """Measure the plan against the plain model again, from the next forward."""
        self._refuse_inside_forward(model, "retune()")
        if self.options.tune is False or clock_of(self.backend, devices(model)[0]) is None:
            raise OOOConfigError(
                "retune() measures the plan on the device, but this model does not tune "
                "(tune=False, or its backend cannot time steps); wrap it with tune=True on an "
                "accelerator"
            )
        if self.phase in (Phase.LEARNING, Phase.TUNING):
            return  # the plan is still to be learned, or tuning is underway: it will decide
        if not self.plan.stages and not split_wanted(model, self.options, self.backend):
            raise OOOConfigError(
                "retune() has no plan to measure: this model runs plain because "
                f"{self._why_plain()}; model.replan() learns a plan again"
            )
        if self.phase is Phase.STOPPED:  # plain was measured faster: put the plan's hooks back
            self._schedule(model, self.plan)
        else:
            self._tune(model)

    def graphed(self) -> None:
        """The forward replays a CUDA graph from now on (``make_graphed_callables``)."""
        if self.scheduler is not None:
            self.scheduler.stages_replay_in_a_graph()
        if self.phase is not Phase.TUNING:
            return
        # Its steps are all the captured plan now: tuning stops undecided.
        self._remove("tuner")
        self.phase = Phase.SCHEDULED
        self.log.add(
            OOOEvent(
                EventKind.TUNED,
                "not_finished",
                "the forward replays a CUDA graph now, which holds the plan: tuning stopped "
                "before it decided; tune with eager steps first, or wrap with tune=False",
            ),
            level=logging.INFO,
        )

    def unwrap(self, model: nn.Module) -> None:
        """Remove every hook (-> ``UNWRAPPED``); the model's class is the caller's to restore."""
        self._refuse_inside_forward(model, "unwrap()")
        self.events()  # moves counts taken in compiled code into the log while it can
        self.close()
        self.log.add(
            OOOEvent(EventKind.UNWRAPPED, "unwrap", "hooks removed and class restored"),
            level=logging.INFO,
        )

    def close(self) -> None:
        """Remove every hook, whatever the phase (also to undo a wrap that failed)."""
        self._remove(*_ALL)
        self.phase = Phase.UNWRAPPED

    # --- transitions the hooks make -----------------------------------------------------

    def _learn(self, model: nn.Module, device: torch.device) -> None:
        """-> ``LEARNING`` on ``device``."""
        options = self.options
        with self._as_before_on_error():
            self.learner = Learner(
                options.streams,
                options.stages,
                self.backend,
                device,
                self.counters,
                self.accumulators,
                gpu=options.gpu,
                log=self.log,
            )
            hooks = self._hooks["learner"]
            hooks.append(
                model.register_forward_pre_hook(self._learner_pre, with_kwargs=True, prepend=True)
            )
            hooks.append(
                model.register_forward_hook(self._learner_post, with_kwargs=True, always_call=True)
            )
            self.plan, self.phase = pending_plan(options.streams), Phase.LEARNING

    def _learner_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if (learner := self.learner) is not None and (learned := learner.pre_hook(module)):
            self._learned(module, learned)

    def _learner_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if (learner := self.learner) is not None and (learned := learner.post_hook(module)):
            self._learned(module, learned)

    def _learned(self, model: nn.Module, learned: Learned) -> None:
        """``LEARNING`` -> the plan's hooks, or ``STOPPED`` (an event says why)."""
        the_plan, failure, removed = learned
        self.events()  # logs what the learner noted in compiled code, before it goes
        self._remove("learner")
        self.plan, self.phase = the_plan, Phase.STOPPED
        found = learned_of(the_plan)
        for name in removed:
            self.log.add(removed_before_learning(name), level=logging.WARNING)
        if failure is not None:
            self.log.add(
                OOOEvent(
                    EventKind.PLANNED,
                    "static_fallback",
                    f"{failure}; using the static plan (stage names or automatic expansion, "
                    "streams round-robin)",
                ),
                level=logging.WARNING,
            )
        elif found is not None:
            for event in learned_events(the_plan):
                self.log.add(event, level=logging.INFO)
        alone = split_alone(model, the_plan, failure, self.options, self.backend)
        if alone is not None:
            the_plan = self.plan = alone  # a chain with the split in force: the split alone
        elif found is not None and found.outcome == "no_parallelism":
            self._stop(Reason.NO_PARALLELISM, found.no_parallelism_message)
            return
        elif not the_plan.stages or (failure is not None and len(the_plan.stages) < 2):
            self._stop(Reason.TOO_FEW_STAGES, "fewer than two stages: nothing to overlap")
            return
        if len(the_plan.devices) > 1:
            self._stop(Reason.MULTI_DEVICE, "stages span several devices")
            return
        device = plan_device(model, the_plan)
        if (reason := self.backend.unsupported_reason(device)) is not None:
            self._stop(reason, f"the stages' device {device} has no side streams")
            return
        try:
            self._schedule(model, the_plan)
        except Exception as error:
            self._stop(Reason.SETUP_FAILED, f"setup failed ({type(error).__name__}: {error})")

    def _schedule(self, model: nn.Module, the_plan: Plan) -> None:
        """-> ``SCHEDULED`` with the plan's streams and scheduler, then ``TUNING`` if the
        options tune and the backend can time steps."""
        backend, device = self.backend, plan_device(model, the_plan)
        with self._as_before_on_error():
            streams = [backend.new_stream(device) for _ in range(the_plan.num_streams)]
            # Picked here, once: the hooks carry no code for the options that are off.
            scheduler_type = scheduler_class(
                overlap_forward=self.options.overlap_forward,
                profile_ranges=self.options.profile_ranges,
            )
            scheduler = scheduler_type(the_plan, streams, backend, self.log, self.counters, device)
            self.scheduler = scheduler
            scheduler.install(model, self._hooks["scheduler"])
            scheduler.accumulators = self.accumulators
            if split_wanted(model, self.options, backend, device):
                parts = self.options, backend, self.counters, self.log
                scheduler.weight_grads = start_split(model, scheduler, the_plan, *parts)
            self.plan, self.phase = the_plan, Phase.SCHEDULED
            self._tune(model)

    def _tune(self, model: nn.Module) -> None:
        """``SCHEDULED`` -> ``TUNING``, if the options tune and the backend can time steps."""
        scheduler, device = self.scheduler, plan_device(model, self.plan)
        clock = clock_of(self.backend, device)
        if self.options.tune is False or clock is None or scheduler is None:
            return
        with self._as_before_on_error():
            steps = self.options.tune_steps
            self.tuner = Tuner(scheduler, self.backend, self.log, device, clock, steps, model)
            hooks = self._hooks["tuner"]
            # After the scheduler's: its root pre-hook opens the root call the tuner reads.
            hooks.append(model.register_forward_pre_hook(self.tuner.pre_hook, with_kwargs=True))
            hooks.append(
                model.register_forward_hook(self._tuner_post, with_kwargs=True, always_call=True)
            )
            self.phase, self.decided = Phase.TUNING, None

    def _tuner_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """``TUNING`` -> ``SCHEDULED`` (plan kept) or ``STOPPED`` once the tuner decides."""
        tuner = self.tuner
        decision = "pending" if tuner is None else tuner.post_hook(module)
        if tuner is None or decision == "pending":
            return
        record = tuner.record(decision)
        self._remove("tuner")
        self.phase, self.decided = Phase.SCHEDULED, record
        if record.speedup is not None and decision == "plain":
            self._stop(Reason.MEASURED_SLOWER, slower_why(record))
        else:
            self.log.add(tuned_event(record), level=logging.INFO)

    def _stop(self, reason: str, why: str) -> None:
        """-> ``STOPPED``: no hook at all from now on; the model runs as if unwrapped."""
        self._remove(*_ALL)
        self.phase = Phase.STOPPED
        again = (
            "model.replan() learns again on the next training forward"
            if self.options.planner == "dataflow"
            else "model.retune() measures again"
        )
        self.log.add(
            OOOEvent(
                EventKind.DISABLED,
                reason,
                f"{why}; every forward from now on runs the plain model, with no hook at all "
                f"({again})",
            ),
            level=logging.INFO,
        )

    # --- helpers ------------------------------------------------------------------------

    def _remove(self, *parts: Part) -> None:
        """Remove the hooks of ``parts`` and let go of what ran them: the one place the
        wrapper's hooks come off. The caller sets the phase."""
        for part in parts:
            for handle in self._hooks[part]:
                handle.remove()
            self._hooks[part].clear()
        if "learner" in parts and self.learner is not None:
            self.learner.close()  # an observation an interrupted forward left
            self.learner = None
        if "tuner" in parts and self.tuner is not None:
            self.decided = self.tuner.record()  # as far as it got
            self.tuner.close()
            self.tuner = None
        if "scheduler" in parts and self.scheduler is not None:
            self.scheduler.release()
            self.scheduler = None

    @contextlib.contextmanager
    def _as_before_on_error(self) -> Iterator[None]:
        """If the block raises, remove the parts it added and put the phase (and the last
        tuning) back, then let the error propagate."""
        phase, plan, decided = self.phase, self.plan, self.decided
        try:
            yield
        except BaseException:
            self._remove(*(part for part in _ALL if part not in _PARTS[phase]))
            self.phase, self.plan, self.decided = phase, plan, decided
            raise

    def _refuse_inside_forward(self, model: nn.Module, call: str) -> None:
        """Refuse ``call`` while a forward of ``model`` runs on this thread: it removes the
        hooks, so the post-hook of the stage running now (which restores the caller's
        stream) or of the root (which ends the planner's observation) would never run."""
        learner = self.learner
        if running(model, self.scheduler, learner is not None and learner.observing):
            raise OOOError(
                f"{call} was called inside a forward of this {type(model).__name__} (from a "
                "stage's forward, or a hook); it removes the hooks that restore your stream "
                "(and end the planner's observation) when the forward returns, so nothing was "
                "changed. Call it between forwards (a router that decides to replan can set a "
                "flag in forward and call it after the step)"
            )

    def _why_plain(self) -> str:
        disabled = [e for e in self.log.snapshot() if e.kind is EventKind.DISABLED]
        return disabled[-1].reason if disabled else "it has no stages"
