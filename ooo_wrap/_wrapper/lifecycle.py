"""The wrap state machine: what the wrapper holds for one wrapped model, and every change.

A wrapped model is always in one :class:`Phase`, and only the transitions here add or
remove the wrapper's hooks (``_remove`` is the one place they come off):

Its phases, their hooks and the legal transitions are one table (``phases.py``).

From outside: ``replan()`` moves any other phase to ``LEARNING``; ``retune()`` moves
``SCHEDULED`` and ``STOPPED`` (with candidates) to ``TUNING``; ``unwrap()`` moves any
phase to ``UNWRAPPED``. Those three are refused inside a forward of the model and change
nothing then. A transition
that adds hooks and fails removes what it added and leaves the phase as it was before
them (``replan()`` has taken the old hooks off by then, so a failure there leaves the
model ``STOPPED``, running plain). A wrap state never refers to its model (the hooks are
passed it), so the registry keyed weakly by the model keeps nothing alive.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._errors import OOOConfigError, OOOError
from .._events import EventKind, EventLog, OOOEvent
from .._plan import Plan
from .._reasons import Reason
from .._runtime.accumulators import Accumulators
from .._runtime.backend import Backend, clock_of
from .._runtime.scheduler import Scheduler, running
from .._runtime.wgrad import split_layers
from .._stats import Counters
from .arms import Arm
from .choice import choose
from .learn import Learned, Learner, learning_events, pending_plan
from .options import WrapOptions
from .phases import ALL, PARTS, Part, Phase, transition
from .racing import ArmHooks, Schedulers
from .shared import Shared
from .split import devices, plan_device, split_event
from .tune import Tuner
from .tuning import Shape, Tuning, kept_event, shape_of, slower_why

__all__ = ["Phase", "WrapState", "devices"]


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
    # The last tuning, as far as it got; None if it never tuned.
    decided: Tuning | None = field(default=None, init=False)
    # The input shapes of the forward the plan was learned on (a cached decision stands
    # only for shapes it raced); None if no forward was observed.
    learned_on: Shape | None = field(default=None, init=False)
    _hooks: dict[Part, list[RemovableHandle]] = field(
        default_factory=lambda: {part: [] for part in ALL}, init=False
    )

    def __post_init__(self) -> None:
        parts = (self.backend, self.log, self.counters, self.accumulators)
        self._schedulers = Schedulers(*parts, self.options.profile_ranges)

    @property
    def handles(self) -> list[RemovableHandle]:
        """Every hook of the wrapper on the model, in install order (a new list)."""
        return [handle for part in ALL for handle in self._hooks[part]]

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
        self._remove(*ALL)
        self._enter(Phase.STOPPED)
        self._learn(model, device)
        again = "the plan is learned again on the next forward"
        self.log.add(OOOEvent(EventKind.PLANNED, "replan", again), level=logging.INFO)

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
        self._remove(*ALL)
        self._enter(Phase.STOPPED)
        self._race(model, self.arms, recall=False)

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
            why = (
                f"the forward replays a CUDA graph now, which holds the {active.name} arm, "
                "unmeasured as a graph: tuning stopped (eager step times do not apply to a "
                "replay); ooo_wrap.graphed_step races the arms as graphs, or pin one with "
                "tune_arm=..."
            )
            self.log.add(OOOEvent(EventKind.TUNED, "not_finished", why), level=logging.INFO)
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
        self._remove(*ALL)
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
                # finds is a candidate; else the simulator keeps only the regions its
                # estimate says pay.
                by_simulation=not (self.tunes(model) or options.tune_arm is not None),
            )
            hooks = self._hooks["learner"]
            hooks.append(
                model.register_forward_pre_hook(self._learner_pre, with_kwargs=True, prepend=True)
            )
            hooks.append(
                model.register_forward_hook(self._learner_post, with_kwargs=True, always_call=True)
            )
            self.plan = pending_plan(options.streams)
            self.learned_on = None
            self._enter(Phase.LEARNING)

    def _learner_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if (learner := self.learner) is not None and (learned := learner.pre_hook(module)):
            self._learned(module, learned)

    def _learner_post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if (learner := self.learner) is not None and (learned := learner.post_hook(module)):
            self.learned_on = shape_of(args, kwargs)
            self._learned(module, learned)

    def _learned(self, model: nn.Module, learned: Learned) -> None:
        """``LEARNING`` -> the plan's hooks, or ``STOPPED`` (an event says why)."""
        the_plan, failure, removed = learned
        self.events()  # logs what the learner noted in compiled code, before it goes
        self._remove("learner")
        self.plan = the_plan
        self._enter(Phase.STOPPED)
        for event, level in learning_events(the_plan, failure, removed):
            self.log.add(event, level=level)
        try:
            self._begin(model, the_plan, failure)
        except Exception as error:
            self._stop(Reason.SETUP_FAILED, f"setup failed ({type(error).__name__}: {error})")

    def _begin(self, model: nn.Module, the_plan: Plan, failure: str | None) -> None:
        """A plan is known: race its arms, run one, or stop (``choice.py``)."""
        self.plan = the_plan
        choice = choose(model, the_plan, failure, self.options, self.backend, self.tunes(model))
        self.arms = choice.arms
        if choice.race:
            self._race(model, choice.arms)
        elif choice.run is not None:
            self._schedule(model, choice.run)
            if choice.why:
                event = OOOEvent(EventKind.TUNED, "pinned", choice.why)
                self.log.add(event, level=logging.INFO)
        else:
            self._stop(choice.reason, choice.why)

    def _schedule(self, model: nn.Module, arm: Arm) -> None:
        """-> ``SCHEDULED``: ``arm``'s hooks, for good."""
        with self._as_before_on_error():
            self.scheduler = scheduler = self._schedulers(model, arm)
            scheduler.install(model, self._hooks["scheduler"])
            if scheduler.weight_grads is not None:
                layers = split_layers(model, self.options.split_weight_grads_exclude)
                scheduler.weight_grads.install(layer for _, layer in layers)
                self.log.add(split_event(arm.plan, len(layers)), level=logging.INFO)
            self.plan = arm.plan
            self._enter(Phase.SCHEDULED)

    def _race(self, model: nn.Module, arms: tuple[Arm, ...], recall: bool = True) -> None:
        """-> ``TUNING``: the tuner's hooks, racing ``arms`` (plain first); ``recall``: a
        cached decision may stand (not after ``retune()``)."""
        device, options = plan_device(model, self.plan), self.options
        clock = clock_of(self.backend, device)
        assert clock is not None  # _tunes() said so
        with self._as_before_on_error():
            layers = split_layers(model, options.split_weight_grads_exclude)
            racing = ArmHooks(model, self._schedulers, [layer for _, layer in layers])
            racing.handles = self._hooks["arm"]
            self.racing = racing
            shared = Shared(model, options, arms, device, recall=recall, learned_on=self.learned_on)
            parts = (self.backend, self.log, device, clock, options.tune_steps, self.accumulators)
            self.tuner = tuner = Tuner(arms, racing.switch, *parts, shared, model)
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
        if tuner is not None and tuner.post_hook(module, args, kwargs, output):
            self.apply_decision(module)

    def apply_decision(self, model: nn.Module) -> None:
        """``TUNING`` -> ``SCHEDULED`` (an arm kept) or ``STOPPED``: the tuner decided."""
        tuner = self.tuner
        assert tuner is not None and tuner.decision != "pending"
        record = tuner.record()
        winner = next(arm for arm in self.arms if arm.name == record.decision)
        self._remove("tuner", "arm")
        self._enter(Phase.STOPPED)
        self.decided = record
        # A decision from the cache (taken as is, or confirmed now or not) says so.
        cached = OOOEvent(EventKind.TUNED, "cached", record.why) if tuner.recalled else None
        if cached is not None:
            self.log.add(cached, level=logging.INFO)
        if winner.is_plain:
            return self._stop(Reason.MEASURED_SLOWER, record.why if cached else slower_why(record))
        self._schedule(model, winner)
        if cached is None:
            self.log.add(kept_event(record), level=logging.INFO)

    def _stop(self, reason: str, why: str) -> None:
        """-> ``STOPPED``: no hook at all from now on; the model runs as if unwrapped."""
        self._remove(*ALL)
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
            self._remove(*(part for part in ALL if part not in PARTS[phase]))
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
        """Move to ``phase``, if the table allows it from the phase now."""
        self.phase = transition(self.phase, phase)

    def tunes(self, model: nn.Module) -> bool:
        """Whether the options tune and the backend can time steps on the model's device."""
        clock = clock_of(self.backend, devices(model)[0]) if devices(model) else None
        return self.options.tune is not False and clock is not None

    def _why_plain(self) -> str:
        disabled = [e for e in self.log.snapshot() if e.kind is EventKind.DISABLED]
        return disabled[-1].reason if disabled else "it has no stages"
