"""The wrap state machine: what the wrapper holds for one wrapped model, and every change.

A wrapped model is always in one :class:`Phase`, and only the transitions here add or
remove the wrapper's hooks (``_remove`` is the one place they come off):

- ``LEARNING``: the learner's root hooks (``dataflow``) until the first eligible training
  forward returns; its plan moves the model to ``SCHEDULED`` (then ``TUNING``), or to
  ``STOPPED`` when there is nothing to overlap or the plan cannot start.
- ``SCHEDULED``: one arm's scheduler hooks (the stages' and the root's), and the split
  layers' swapped classes where it runs with the weight-gradient split (``split.py``).
- ``TUNING``: the tuner's root hooks and the hooks of the arm it times (``racing.py``),
  until ``SCHEDULED`` (an arm kept, or a CUDA graph replays the forward: undecided) or
  ``STOPPED`` (plain kept, ``measured_slower``).
- ``STOPPED``: no hook at all: the model runs plain, still wrapped. ``UNWRAPPED``: final.

From outside: ``replan()`` moves any other phase to ``LEARNING``; ``retune()`` moves
``SCHEDULED`` and ``STOPPED`` (with candidates) to ``TUNING``; ``unwrap()`` moves any
phase to ``UNWRAPPED``. ``_LEGAL`` is the table of transitions; any other raises. Those
three are refused inside a forward of the model and change nothing then. A transition
that adds hooks and fails removes what it added and leaves the phase as it was before
them (``replan()`` has taken the old hooks off by then, so a failure there leaves the
model ``STOPPED``, running plain). A wrap state never refers to its model (the hooks are
passed it), so the registry keyed weakly by the model keeps nothing alive.
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
from .._planner.api import reference_gpu
from .._planner.learned_plan import LearnedPlan, learned_of
from .._planner.static import static_plan
from .._reasons import Reason
from .._runtime.accumulators import Accumulators
from .._runtime.backend import Backend, Stream, clock_of
from .._runtime.scheduler import Scheduler, running
from .._runtime.variants import scheduler_class
from .._runtime.wgrad import WeightGradSplit, split_layers
from .._stats import Counters
from .arms import Arm, candidates, plain_arm, raced
from .estimates import arm_estimate, forms_chain
from .learn import Learned, Learner, learned_events, pending_plan, removed_before_learning
from .options import WrapOptions
from .racing import ArmHooks
from .split import devices, plan_device, split_alone, split_event, split_wanted
from .tune import Tuner
from .tuning import Tuning, kept_event, slower_why

__all__ = ["Phase", "WrapState", "devices"]


class Phase(enum.Enum):
    """Which hooks of the wrapper a wrapped model carries (see the module docstring)."""

    LEARNING = "learning"
    SCHEDULED = "scheduled"
    TUNING = "tuning"
    STOPPED = "stopped"
    UNWRAPPED = "unwrapped"


Part = Literal["learner", "scheduler", "tuner", "arm"]
# Every legal transition: a phase -> the phases it may move to.
_LEGAL: dict[Phase, frozenset[Phase]] = {
    Phase.LEARNING: frozenset({Phase.SCHEDULED, Phase.TUNING, Phase.STOPPED, Phase.UNWRAPPED}),
    Phase.SCHEDULED: frozenset({Phase.TUNING, Phase.LEARNING, Phase.STOPPED, Phase.UNWRAPPED}),
    Phase.TUNING: frozenset({Phase.SCHEDULED, Phase.STOPPED, Phase.LEARNING, Phase.UNWRAPPED}),
    Phase.STOPPED: frozenset(
        {Phase.LEARNING, Phase.SCHEDULED, Phase.TUNING, Phase.STOPPED, Phase.UNWRAPPED}
    ),
    Phase.UNWRAPPED: frozenset({Phase.UNWRAPPED}),  # closing twice changes nothing
}
# The parts whose hooks each phase carries (installed, and listed in handles, in _ALL order).
_PARTS: dict[Phase, tuple[Part, ...]] = {
    Phase.LEARNING: ("learner",),
    Phase.SCHEDULED: ("scheduler",),
    Phase.TUNING: ("tuner", "arm"),
    Phase.STOPPED: (),
    Phase.UNWRAPPED: (),
}
_ALL: tuple[Part, ...] = ("learner", "scheduler", "tuner", "arm")


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
    racing: ArmHooks | None = field(default=None, init=False)  # the hooks of the arm timed
    # The arms measured tuning races (plain first); empty until there is a plan.
    arms: tuple[Arm, ...] = field(default=(), init=False)
    _streams: list[Stream] = field(default_factory=list, init=False)  # shared by the arms
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
            self._begin(model, self.plan, None)
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
        self._enter(Phase.STOPPED)
        self._learn(model, device)
        self.log.add(
            OOOEvent(EventKind.PLANNED, "replan", "the plan is learned again on the next forward"),
            level=logging.INFO,
        )

    def retune(self, model: nn.Module) -> None:
        """Race the candidate arms again, from the next forward."""
        self._refuse_inside_forward(model, "retune()")
        if not self.tunes(model):
            raise OOOConfigError(
                "retune() measures the plan on the device, but this model does not tune "
                "(tune=False, or its backend cannot time steps); wrap it with tune=True on an "
                "accelerator"
            )
        if self.phase in (Phase.LEARNING, Phase.TUNING):
            return  # the plan is still to be learned, or tuning is underway: it will decide
        if len(self.arms) < 2:
            raise OOOConfigError(
                "retune() has no plan to measure: this model runs plain because "
                f"{self._why_plain()}; model.replan() learns a plan again"
            )
        self._remove(*_ALL)
        self._enter(Phase.STOPPED)
        self._race(model, self.arms)

    def graphed(self, model: nn.Module) -> None:
        """The forward replays a CUDA graph from now on (``make_graphed_callables``)."""
        tuner = self.tuner
        if self.phase is Phase.TUNING and tuner is not None:
            # Its steps are all the captured arm now: tuning stops undecided.
            active = tuner.active
            self._remove("tuner", "arm")
            self._enter(Phase.STOPPED)
            if not active.is_plain:
                self._schedule(model, active)
            self.log.add(
                OOOEvent(
                    EventKind.TUNED,
                    "not_finished",
                    f"the forward replays a CUDA graph now, which holds the {active.name} arm: "
                    "tuning stopped before it decided; tune with eager steps first, or wrap "
                    "with tune=False",
                ),
                level=logging.INFO,
            )
        if self.scheduler is not None:
            self.scheduler.stages_replay_in_a_graph()

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
        self._enter(Phase.UNWRAPPED)

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
                # Where the device decides (or an arm is pinned), every region the rule
                # finds is a candidate; else the planner's default (the simulator keeps
                # only the regions its estimate says pay).
                by_simulation=False if self.tunes(model) or options.tune_arm else None,
            )
            hooks = self._hooks["learner"]
            hooks.append(
                model.register_forward_pre_hook(self._learner_pre, with_kwargs=True, prepend=True)
            )
            hooks.append(
                model.register_forward_hook(self._learner_post, with_kwargs=True, always_call=True)
            )
            self.plan = pending_plan(options.streams)
            self._enter(Phase.LEARNING)

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
        self.plan = the_plan
        self._enter(Phase.STOPPED)
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
        try:
            self._begin(model, the_plan, failure)
        except Exception as error:
            self._stop(Reason.SETUP_FAILED, f"setup failed ({type(error).__name__}: {error})")

    def _begin(self, model: nn.Module, the_plan: Plan, failure: str | None) -> None:
        """A plan is known: race its candidate arms where the device can time steps (or
        run the one pinned), else run it as the planner decided; ``STOPPED`` if nothing
        can run on a side stream."""
        self.plan = the_plan
        if len(the_plan.devices) > 1:
            self._stop(Reason.MULTI_DEVICE, "stages span several devices")
            return
        device = plan_device(model, the_plan)
        if (reason := self.backend.unsupported_reason(device)) is not None:
            self._stop(reason, f"the stages' device {device} has no side streams")
            return
        if self.tunes(model) or self.options.tune_arm is not None:
            self.arms = (plain_arm(the_plan), *self._candidates(model, the_plan, failure))
            self._race_or_pin(model)
        else:
            self._run_as_planned(model, the_plan, failure)

    def _candidates(self, model: nn.Module, the_plan: Plan, failure: str | None) -> tuple[Arm, ...]:
        options = self.options
        plans = [("static" if failure or options.planner == "static" else "regions", the_plan)]
        if plans[0][0] == "regions":
            static = static_plan(model, options.streams, options.stages)
            if not forms_chain(the_plan, static):  # a chain of stages can never be faster
                plans.append(("static", static))
        can_split = bool(split_layers(model, options.split_weight_grads_exclude))
        found = candidates(
            plans,
            split=options.split_weight_grads,
            can_split=can_split,
            overlap=options.overlap_forward,
            estimate=arm_estimate(the_plan, reference_gpu(options.gpu)),
        )
        return found if options.tune_arm is not None else raced(found, options.tune_arms)

    def _race_or_pin(self, model: nn.Module) -> None:
        pinned = self.options.tune_arm
        if pinned is None and len(self.arms) > 1:
            self._race(model, self.arms)
            return
        arm = next((arm for arm in self.arms if arm.name == pinned), None)
        if arm is not None and not arm.is_plain:
            self._schedule(model, arm)
            why = f"the {arm.name} arm was pinned (tune_arm={pinned!r}): nothing was raced"
            self.log.add(OOOEvent(EventKind.TUNED, "pinned", why), level=logging.INFO)
        elif pinned is not None:
            names = ", ".join(a.name for a in self.arms)
            self._stop(Reason.PINNED, f"tune_arm={pinned!r} pinned; the arms were {names}")
        else:
            self._stop_without_stages(learned_of(self.plan))

    def _run_as_planned(self, model: nn.Module, the_plan: Plan, failure: str | None) -> None:
        """Tuning off: the plan as the planner decided (the simulator its prior), with the
        split only where ``split_weight_grads=True`` asks for it."""
        split = split_wanted(model, self.options, self.backend)
        alone = split_alone(model, the_plan, failure, self.options, self.backend)
        if alone is not None:
            the_plan = alone  # a chain with the split in force: the split alone
        elif failure is None and (found := learned_of(the_plan)) is not None:
            if found.outcome == "no_parallelism" or not the_plan.stages:
                self._stop_without_stages(found)
                return
        elif not the_plan.stages or (failure is not None and len(the_plan.stages) < 2):
            self._stop_without_stages(None)
            return
        self._schedule(model, Arm("plan", the_plan, split, self.options.overlap_forward))

    def _stop_without_stages(self, found: LearnedPlan | None) -> None:
        if found is not None and found.outcome == "no_parallelism":
            self._stop(Reason.NO_PARALLELISM, found.no_parallelism_message)
        else:
            self._stop(Reason.TOO_FEW_STAGES, "fewer than two stages: nothing to overlap")

    def _scheduler_for(self, model: nn.Module, arm: Arm) -> Scheduler:
        """A new scheduler for ``arm`` (its split made, its layers not yet swapped)."""
        backend, device = self.backend, plan_device(model, arm.plan)
        while len(self._streams) < arm.plan.num_streams:
            self._streams.append(backend.new_stream(device))
        # Picked here, once: the hooks carry no code for the options that are off.
        scheduler_type = scheduler_class(
            overlap_forward=arm.overlap, profile_ranges=self.options.profile_ranges
        )
        streams = self._streams[: arm.plan.num_streams]
        scheduler = scheduler_type(arm.plan, streams, backend, self.log, self.counters, device)
        scheduler.accumulators, scheduler.layout = self.accumulators, arm.name
        if arm.split:
            scheduler.weight_grads = WeightGradSplit(scheduler, backend, self.counters, self.log)
        return scheduler

    def _schedule(self, model: nn.Module, arm: Arm) -> None:
        """-> ``SCHEDULED``: ``arm``'s hooks, for good."""
        with self._as_before_on_error():
            self.scheduler = scheduler = self._scheduler_for(model, arm)
            scheduler.install(model, self._hooks["scheduler"])
            if scheduler.weight_grads is not None:
                layers = split_layers(model, self.options.split_weight_grads_exclude)
                scheduler.weight_grads.install(layer for _, layer in layers)
                self.log.add(split_event(arm.plan, len(layers)), level=logging.INFO)
            self.plan = arm.plan
            self._enter(Phase.SCHEDULED)

    def _race(self, model: nn.Module, arms: tuple[Arm, ...]) -> None:
        """-> ``TUNING``: the tuner's hooks, racing ``arms`` (plain first)."""
        device, options = plan_device(model, self.plan), self.options
        clock = clock_of(self.backend, device)
        assert clock is not None  # _tunes() said so
        with self._as_before_on_error():
            layers = split_layers(model, options.split_weight_grads_exclude)
            racing = ArmHooks(model, self._scheduler_for, [layer for _, layer in layers])
            racing.handles = self._hooks["arm"]
            self.racing = racing
            parts = (self.backend, self.log, device, clock, options.tune_steps, self.accumulators)
            self.tuner = tuner = Tuner(arms, racing.switch, *parts, model)
            hooks = self._hooks["tuner"]
            # Before the user's pre-hooks, as a scheduler's root pre-hook is.
            pre = model.register_forward_pre_hook(tuner.pre_hook, with_kwargs=True, prepend=True)
            hooks.append(pre)
            hooks.append(
                model.register_forward_hook(self._tuner_post, with_kwargs=True, always_call=True)
            )
            self.decided = None
            self._enter(Phase.TUNING)

    def _tuner_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """``TUNING`` -> ``SCHEDULED`` (an arm kept) or ``STOPPED`` once the tuner decides."""
        tuner = self.tuner
        if tuner is None or not tuner.post_hook(module, args, kwargs, output):
            return
        record = tuner.record()
        winner = next(arm for arm in self.arms if arm.name == record.decision)
        self._remove("tuner", "arm")
        self._enter(Phase.STOPPED)
        self.decided = record
        if winner.is_plain:
            self._stop(Reason.MEASURED_SLOWER, slower_why(record))
            return
        self._schedule(module, winner)
        self.log.add(kept_event(record), level=logging.INFO)

    def _stop(self, reason: str, why: str) -> None:
        """-> ``STOPPED``: no hook at all from now on; the model runs as if unwrapped."""
        self._remove(*_ALL)
        self._enter(Phase.STOPPED)
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
        if "arm" in parts and self.racing is not None:
            self.racing.close()
            self.racing = None
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
        learner, tuner = self.learner, self.tuner
        scheduler = self.scheduler if tuner is None else tuner.scheduler
        if (tuner is not None and tuner.in_forward) or running(
            model, scheduler, learner is not None and learner.observing
        ):
            raise OOOError(
                f"{call} was called inside a forward of this {type(model).__name__} (from a "
                "stage's forward, or a hook); it removes the hooks that restore your stream "
                "(and end the planner's observation) when the forward returns, so nothing was "
                "changed. Call it between forwards (a router that decides to replan can set a "
                "flag in forward and call it after the step)"
            )

    def _enter(self, phase: Phase) -> None:
        """Move to ``phase``, if ``_LEGAL`` allows it from the phase now."""
        if phase not in _LEGAL[self.phase]:
            raise OOOError(
                f"ooo_wrap bug: a wrapped model may not go from {self.phase.value} to "
                f"{phase.value}; please report it (model.events tells what happened)"
            )
        self.phase = phase

    def tunes(self, model: nn.Module) -> bool:
        """Whether the options tune and the backend can time steps on the model's device."""
        clock = clock_of(self.backend, devices(model)[0]) if devices(model) else None
        return self.options.tune is not False and clock is not None

    def _why_plain(self) -> str:
        disabled = [e for e in self.log.snapshot() if e.kind is EventKind.DISABLED]
        return disabled[-1].reason if disabled else "it has no stages"
