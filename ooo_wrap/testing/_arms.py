"""Which arms ``check()`` proves: every candidate the tuner might keep, learned once.

A copy of the model is wrapped with ``tune_arm="plain"`` (so nothing runs on a side
stream and nothing is raced, whatever the backend) and, where its plan is learned from the
dataflow, runs the first training forward; its wrap state then lists every candidate
arm, not only the ones tuning would race. ``check()`` proves each of them on a fresh copy.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from .._errors import OOOConfigError
from .._events import EventKind, OOOEvent
from .._reasons import Reason
from .._wrapper.arms import Arm
from .._wrapper.module import OOOModule
from .._wrapper.registry import events_for, price_as_graph_replay, wrapped
from ._detect import DetectingBackend
from ._report import CheckReport, ParityEntry

__all__ = ["Candidates", "combined", "learn_candidates", "refuse_unknown_arm"]


@dataclass(frozen=True)
class Candidates:
    """The candidate arms (plain left out), or why the model runs plain."""

    arms: tuple[Arm, ...]
    # Why no arm runs anything on a side stream (when ``names`` is empty and the wrapper
    # did not fail); None otherwise.
    runs_plain: str | None = None
    # The wrapper's setup failure, if the copy could not be wrapped: nothing was proved.
    setup_failed: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(arm.name for arm in self.arms)


def learn_candidates(
    model: nn.Module,
    forward: Callable[[nn.Module], object],
    options: dict[str, Any],
    graphed: bool = False,
) -> Candidates:
    """The candidate arms of ``model`` wrapped with ``options``; ``forward`` runs the
    training forward a learned plan needs (on a copy, which is then dropped); ``graphed``:
    the plan priced as a CUDA graph replay."""
    probe = OOOModule(copy.deepcopy(model), backend=DetectingBackend(), tune_arm="plain", **options)
    if graphed:
        price_as_graph_replay(probe)
    state = wrapped.get(probe)
    if state is not None and not state.arms:
        forward(probe)  # the dataflow planner learns the plan, and the arms, here
        state = wrapped.get(probe)
    arms = tuple(arm for arm in state.arms if not arm.is_plain) if state else ()
    if arms:
        return Candidates(arms)
    events = events_for(probe)
    failed = [e for e in events if e.kind is EventKind.SETUP_FAILED or e.reason == "setup_failed"]
    if failed:
        return Candidates((), setup_failed=f"{failed[-1].reason}: {failed[-1].message}")
    return Candidates((), runs_plain=_why_plain(events, options))


def _why_plain(events: tuple[OOOEvent, ...], options: dict[str, Any]) -> str:
    disabled = [e for e in events if e.kind is EventKind.DISABLED and e.reason != Reason.PINNED]
    if disabled:
        why = f"{disabled[-1].reason}: {disabled[-1].message}"
    else:
        split = (
            "the weight-gradient split is off (split_weight_grads=False)"
            if options.get("split_weight_grads") is False
            else "no layer whose weight gradient splits"
        )
        why = f"no candidate arm: no two stages can run at the same time, and {split}"
    return (
        f"the model runs plain ({why}), so nothing runs on a side stream and nothing can "
        "race: no arm to check"
    )


def combined(reports: Sequence[tuple[str, CheckReport]]) -> CheckReport:
    """One report of several arms' (each ``(arm, its report)``): every arm's findings,
    the worst parity per output and gradient, the ops and trace of the arm shown."""
    if len(reports) == 1:
        return reports[0][1]
    arms = tuple(name for name, _ in reports)
    parts = tuple(report for _, report in reports)
    worst: dict[str, float] = {}
    for part in parts:
        for entry in part.parity:
            worst[entry.name] = max(worst.get(entry.name, 0.0), entry.max_abs_diff)
    unchecked = [f"{name}: {r.not_checked}" for name, r in reports if r.not_checked is not None]
    first = parts[0]
    whole = CheckReport(
        races=tuple(race for part in parts for race in part.races),
        allocator_hazards=tuple(hazard for part in parts for hazard in part.allocator_hazards),
        parity=tuple(ParityEntry(name, diff) for name, diff in worst.items()),
        ops=(),
        trace=(),
        notes=tuple(dict.fromkeys(note for part in parts for note in part.notes)),
        steps=first.steps,
        captured=first.captured,
        not_checked="; ".join(unchecked) if unchecked else None,
        overlap_forward=first.overlap_forward,
        gpu=first.gpu,
        arms=arms,
        by_arm=parts,
    )
    shown = whole.arm_report(str(whole.shown_arm))  # the first arm not ok, else the first
    return dataclasses.replace(
        whole,
        ops=shown.ops,
        trace=shown.trace,
        learning_step=shown.learning_step,
        plan_estimate=shown.plan_estimate,
        graphed=shown.graphed,
        split=shown.split,
    )


def refuse_unknown_arm(model: nn.Module, arm: str) -> None:
    """Raise if the copy ``model`` stopped because it has no arm ``arm`` (or ``arm`` is
    plain); its arms are known once its plan is."""
    state = wrapped.get(model)
    if state is None or not state.arms or any(a.name == arm and not a.is_plain for a in state.arms):
        return
    names = ", ".join(a.name for a in state.arms if not a.is_plain) or "none"
    raise OOOConfigError(
        f"check(tune_arm={arm!r}): this model has no such arm that runs on side streams; "
        f"its candidate arms are: {names} (tune_arm=None checks every one)"
    )
