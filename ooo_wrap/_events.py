"""What the wrapper decided and did, as frozen records in a bounded log."""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass, replace

__all__ = ["EventKind", "EventLog", "OOOEvent", "ValueEnum"]

logger = logging.getLogger("ooo_wrap")


class ValueEnum(enum.Enum):
    """An enum whose members print as their values (``str()`` and f-strings alike), as the
    messages and reports that show them want."""

    def __str__(self) -> str:
        return str(self.value)


class EventKind(ValueEnum):
    """The kind of an :class:`OOOEvent`."""

    ENABLED = "enabled"
    PLANNED = "planned"  # learned (named stages in one chain said so), static fallback, replan
    DISABLED = "disabled"
    TUNED = "tuned"  # measured tuning kept the plan, or could not finish before a capture
    SETUP_FAILED = "setup_failed"
    BYPASSED = "bypassed"
    STAGE_FAILED = "stage_failed"
    STAGE_NOT_CALLED = "stage_not_called"
    STAGE_REPLACED = "stage_replaced"  # a stage replaced or removed after wrapping
    UNTRACKED = "untracked"
    UNWRAPPED = "unwrapped"


@dataclass(frozen=True)
class OOOEvent:
    """One decision or occurrence, e.g. ``OOOEvent(DISABLED, "cpu", "...")``.

    Attributes:
        kind: what happened.
        reason: a short machine-readable reason, such as ``"cpu"`` or ``"compiling"``.
        message: a human sentence that says what happened and, where useful, what to do.
        stage: the dotted stage name the event concerns, or ``None`` for the whole model.
        count: how many times this (kind, reason, stage) occurred; runtime events are
            deduplicated rather than repeated.
    """

    kind: EventKind
    reason: str
    message: str
    stage: str | None = None
    count: int = 1

    def __str__(self) -> str:
        where = f" [{self.stage}]" if self.stage else ""
        times = f" (x{self.count})" if self.count > 1 else ""
        return f"{self.kind}/{self.reason}{where}: {self.message}{times}"


class EventLog:
    """Events keyed by (kind, reason, stage); a repeat bumps the count and moves it last.

    At most ``capacity`` distinct keys are kept; the oldest is dropped first, so a model
    that runs forever holds a fixed amount of history.
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._events: dict[tuple[EventKind, str, str | None], OOOEvent] = {}
        self._lock = threading.Lock()

    def add(self, event: OOOEvent, *, level: int = logging.DEBUG) -> OOOEvent:
        """Record ``event`` (merging it with an earlier one of the same key) and log it once."""
        key = (event.kind, event.reason, event.stage)
        with self._lock:
            previous = self._events.pop(key, None)
            if previous is not None:
                event = replace(event, count=previous.count + event.count)
            elif len(self._events) >= self._capacity:
                del self._events[next(iter(self._events))]
            self._events[key] = event
        if previous is None:
            logger.log(level, "%s", event)
        return event

    def snapshot(self) -> tuple[OOOEvent, ...]:
        """The events, oldest first."""
        with self._lock:
            return tuple(self._events.values())
