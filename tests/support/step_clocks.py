"""Simulated step clocks for measured tuning: a step's time from the calls it made."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ooo_wrap.testing._simulated import StreamCall

StepTime = Callable[[Sequence[StreamCall]], float]


def forked(calls: Sequence[StreamCall]) -> bool:
    """Whether a step's calls include a stage call run on its side stream."""
    return any(call.op == "set_stream" and call.stream.id != 0 for call in calls)


def planned_ms(plan: float, plain: float) -> StepTime:
    """Steps that used side streams take ``plan`` ms, the others ``plain`` ms."""
    return lambda calls: plan if forked(calls) else plain
