"""What a wrapped model runs once its plan is known: race arms, run one, or run plain.

Where the device can time steps (or an arm is pinned with ``tune_arm``), the plan's
candidate arms (``candidates.py``) are raced, or the pinned one runs; with no candidate
the model runs plain. Where tuning is off, the plan runs as the planner decided (the
simulator its prior), with the weight-gradient split only where
``split_weight_grads=True`` asks for it: options that only tuning may turn on stay off.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .._plan import Plan
from .._planner.learned_plan import LearnedPlan, learned_of
from .._reasons import Reason
from .._runtime.backend import Backend
from .arms import Arm
from .candidates import candidates_for, plain_for
from .options import WrapOptions
from .split import plan_device, split_alone, split_wanted

__all__ = ["Choice", "choose"]


@dataclass(frozen=True)
class Choice:
    """``race``: the arms to race (plain first); ``run``: the one arm to run, with ``why``
    if it was pinned; else stop with ``reason`` and ``why``."""

    arms: tuple[Arm, ...] = ()
    race: bool = False
    run: Arm | None = None
    reason: str = ""
    why: str = ""


def choose(
    model: nn.Module,
    the_plan: Plan,
    failure: str | None,
    options: WrapOptions,
    backend: Backend,
    tunes: bool,
) -> Choice:
    """What runs ``the_plan`` (``failure``: why learning fell back to the static plan)."""
    if len(the_plan.devices) > 1:
        return Choice(reason=Reason.MULTI_DEVICE, why="stages span several devices")
    device = plan_device(model, the_plan)
    if (reason := backend.unsupported_reason(device)) is not None:
        return Choice(reason=reason, why=f"the stages' device {device} has no side streams")
    if not tunes and options.tune_arm is None:
        return _as_planned(model, the_plan, failure, options, backend)
    arms = (plain_for(the_plan, options), *candidates_for(model, the_plan, failure, options))
    pinned = options.tune_arm
    if pinned is None:
        return Choice(arms, race=True) if len(arms) > 1 else _no_stages(arms, the_plan)
    arm = next((arm for arm in arms if arm.name == pinned), None)
    if arm is None or arm.is_plain:
        names = ", ".join(a.name for a in arms)
        why = f"tune_arm={pinned!r} pinned; the arms were {names}"
        return Choice(arms, reason=Reason.PINNED, why=why)
    why = f"the {arm.name} arm was pinned (tune_arm={pinned!r}): nothing was raced"
    return Choice(arms, run=arm, why=why)


def _as_planned(
    model: nn.Module, the_plan: Plan, failure: str | None, options: WrapOptions, backend: Backend
) -> Choice:
    split = split_wanted(model, options, backend)
    alone = split_alone(model, the_plan, failure, options, backend)
    if alone is not None:  # a chain with the split in force: the split alone
        return Choice(run=Arm("plan", alone, split, options.overlap_forward))
    found = learned_of(the_plan) if failure is None else None
    if found is not None and found.outcome == "no_parallelism":
        return _no_stages((), the_plan)
    if not the_plan.stages or (failure is not None and len(the_plan.stages) < 2):
        return _no_stages((), the_plan)
    return Choice(run=Arm("plan", the_plan, split, options.overlap_forward))


def _no_stages(arms: tuple[Arm, ...], the_plan: Plan) -> Choice:
    found: LearnedPlan | None = learned_of(the_plan)
    if found is not None and found.outcome == "no_parallelism":
        return Choice(arms, reason=Reason.NO_PARALLELISM, why=found.no_parallelism_message)
    why = "fewer than two stages: nothing to overlap"
    return Choice(arms, reason=Reason.TOO_FEW_STAGES, why=why)
