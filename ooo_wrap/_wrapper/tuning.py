"""What measured tuning decides from step times, and how ``model.tuning`` reports it.

Pure statistics on the counted step times of the two arms (``tune.py`` times them): the
plan is kept only if its median step beats the plain median by more than the noise (2 %
and the larger arm's interquartile range over its median), plain wins when the plan is
slower by as much, and in between more pairs run, up to ``MAX_ROUNDS`` times the steps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

from .._events import EventKind, OOOEvent

__all__ = ["MAX_ROUNDS", "MIN_GAIN", "Decision", "Tuning", "decide", "slower_why", "tuned_event"]

Decision = Literal["pending", "plan", "plain"]

# The smallest gain worth side streams: below it, run-to-run noise on a busy host and the
# risk of a worse step on another batch outweigh it.
MIN_GAIN = 0.02
# How many times tune_steps pairs may run while the evidence is unclear.
MAX_ROUNDS = 3


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


def _figures(record: Tuning) -> str:
    return (
        f"median step {record.plan_median_ms:.3f} ms with the plan vs "
        f"{record.plain_median_ms:.3f} ms plain ({record.speedup:.2f}x, "
        f"{len(record.plan_ms)} and {len(record.plain_ms)} steps measured on "
        f"{record.device})"
    )


def slower_why(record: Tuning) -> str:
    """Why a ``measured_slower`` model runs plain: the figures."""
    return f"{_figures(record)}: the plan was not measurably faster than the plain model"


def tuned_event(record: Tuning) -> OOOEvent:
    """The ``TUNED`` event of a decided ``record`` that keeps the plan (measured or not)."""
    if record.speedup is None:
        return OOOEvent(
            EventKind.TUNED,
            "unmeasured",
            f"too few steps could be timed on {record.device} ({len(record.plan_ms)} "
            f"planned, {len(record.plain_ms)} plain: input shapes kept changing, or "
            "forwards raised): the plan is kept, unmeasured; model.retune() "
            "measures again",
        )
    return OOOEvent(EventKind.TUNED, "kept", f"{_figures(record)}: the plan is kept")
