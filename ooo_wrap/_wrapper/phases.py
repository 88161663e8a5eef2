"""The phases of a wrapped model: which hooks it carries, and which phase may follow which.

- ``LEARNING``: the learner's root hooks (``dataflow``) until the first eligible training
  forward returns; its plan moves the model to ``SCHEDULED`` (then ``TUNING``), or to
  ``STOPPED`` when there is nothing to overlap or the plan cannot start.
- ``SCHEDULED``: one arm's scheduler hooks (the stages' and the root's), and the split
  layers' swapped classes where it runs with the weight-gradient split (``split.py``).
- ``TUNING``: the tuner's root hooks and the hooks of the arm it times (``racing.py``),
  until ``SCHEDULED`` (an arm kept, or a CUDA graph replays the forward: undecided) or
  ``STOPPED`` (plain kept, ``measured_slower``).
- ``STOPPED``: no hook at all: the model runs plain, still wrapped. ``UNWRAPPED``: final.

``LEGAL`` is the table of transitions; any other raises (a bug in the wrapper).
"""

from __future__ import annotations

import enum
from typing import Literal

from .._errors import OOOError

__all__ = ["ALL", "LEGAL", "PARTS", "Part", "Phase", "transition"]


class Phase(enum.Enum):
    """Which hooks of the wrapper a wrapped model carries (see the module docstring)."""

    LEARNING = "learning"
    SCHEDULED = "scheduled"
    TUNING = "tuning"
    STOPPED = "stopped"
    UNWRAPPED = "unwrapped"


Part = Literal["learner", "scheduler", "tuner", "arm"]
# Every legal transition: a phase -> the phases it may move to.
LEGAL: dict[Phase, frozenset[Phase]] = {
    Phase.LEARNING: frozenset({Phase.SCHEDULED, Phase.TUNING, Phase.STOPPED, Phase.UNWRAPPED}),
    Phase.SCHEDULED: frozenset({Phase.TUNING, Phase.LEARNING, Phase.STOPPED, Phase.UNWRAPPED}),
    Phase.TUNING: frozenset({Phase.SCHEDULED, Phase.STOPPED, Phase.LEARNING, Phase.UNWRAPPED}),
    Phase.STOPPED: frozenset(
        {Phase.LEARNING, Phase.SCHEDULED, Phase.TUNING, Phase.STOPPED, Phase.UNWRAPPED}
    ),
    Phase.UNWRAPPED: frozenset({Phase.UNWRAPPED}),  # closing twice changes nothing
}
# The parts whose hooks each phase carries (installed, and listed in handles, in ALL order).
PARTS: dict[Phase, tuple[Part, ...]] = {
    Phase.LEARNING: ("learner",),
    Phase.SCHEDULED: ("scheduler",),
    Phase.TUNING: ("tuner", "arm"),
    Phase.STOPPED: (),
    Phase.UNWRAPPED: (),
}
ALL: tuple[Part, ...] = ("learner", "scheduler", "tuner", "arm")


def transition(now: Phase, then: Phase) -> Phase:
    """``then``, if ``LEGAL`` allows it after ``now``; else raise :class:`OOOError`."""
    if then not in LEGAL[now]:
        raise OOOError(
            f"ooo_wrap bug: a wrapped model may not go from {now.value} to {then.value}; "
            "please report it (model.events tells what happened)"
        )
    return then
