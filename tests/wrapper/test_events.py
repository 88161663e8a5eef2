"""Events: frozen records, readable kinds, and a bounded, deduplicating log."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest

from ooo_wrap import EventKind, OOOEvent
from ooo_wrap._events import EventLog


def test_event_kinds_values_and_str() -> None:
    assert {kind.name: kind.value for kind in EventKind} == {
        "ENABLED": "enabled",
        "PLANNED": "planned",
        "DISABLED": "disabled",
        "TUNED": "tuned",
        "SETUP_FAILED": "setup_failed",
        "BYPASSED": "bypassed",
        "STAGE_FAILED": "stage_failed",
        "STAGE_NOT_CALLED": "stage_not_called",
        "STAGE_REPLACED": "stage_replaced",
        "UNTRACKED": "untracked",
        "UNWRAPPED": "unwrapped",
    }
    for kind in EventKind:
        assert str(kind) == kind.value
        assert EventKind(kind.value) is kind


def test_event_str_is_readable() -> None:
    assert str(OOOEvent(EventKind.DISABLED, "cpu", "on the CPU")) == "disabled/cpu: on the CPU"
    event = OOOEvent(EventKind.STAGE_FAILED, "ValueError", "stage raised", stage="enc", count=3)
    assert str(event) == "stage_failed/ValueError [enc]: stage raised (x3)"


def test_log_deduplicates_with_a_count_and_moves_the_repeat_last() -> None:
    log = EventLog()
    first = OOOEvent(EventKind.BYPASSED, "disabled", "inline")
    other = OOOEvent(EventKind.ENABLED, "simulated", "on")
    log.add(first)
    log.add(other)
    merged = log.add(first)
    assert merged.count == 2
    assert log.snapshot() == (other, dataclasses.replace(first, count=2))
    log.add(dataclasses.replace(first, count=5))
    assert log.snapshot()[-1].count == 7


def test_log_key_is_kind_reason_and_stage() -> None:
    log = EventLog()
    log.add(OOOEvent(EventKind.STAGE_FAILED, "ValueError", "m", stage="a"))
    log.add(OOOEvent(EventKind.STAGE_FAILED, "ValueError", "m", stage="b"))
    log.add(OOOEvent(EventKind.STAGE_FAILED, "KeyError", "m", stage="a"))
    log.add(OOOEvent(EventKind.BYPASSED, "ValueError", "m", stage="a"))
    log.add(OOOEvent(EventKind.STAGE_FAILED, "ValueError", "a new message", stage="a"))
    snapshot = log.snapshot()
    assert len(snapshot) == 4
    assert snapshot[-1] == OOOEvent(
        EventKind.STAGE_FAILED, "ValueError", "a new message", stage="a", count=2
    )


def test_log_is_bounded_and_drops_the_oldest() -> None:
    log = EventLog(capacity=3)
    events = [OOOEvent(EventKind.BYPASSED, f"r{i}", "m") for i in range(5)]
    for event in events:
        log.add(event)
    assert log.snapshot() == tuple(events[2:])
    log.add(events[2])  # a repeat refreshes it: now the newest, r3 is the oldest
    log.add(events[0])
    assert [e.reason for e in log.snapshot()] == ["r4", "r2", "r0"]
    assert len(log.snapshot()) == 3


def test_snapshot_is_oldest_first_and_a_copy() -> None:
    log = EventLog()
    a = log.add(OOOEvent(EventKind.ENABLED, "a", "m"))
    snapshot = log.snapshot()
    b = log.add(OOOEvent(EventKind.BYPASSED, "b", "m"))
    assert snapshot == (a,)
    assert log.snapshot() == (a, b)


def test_log_logs_each_key_once_at_the_given_level(caplog: pytest.LogCaptureFixture) -> None:
    log = EventLog()
    with caplog.at_level(logging.DEBUG, logger="ooo_wrap"):
        for _ in range(10):
            log.add(OOOEvent(EventKind.BYPASSED, "disabled", "inline"), level=logging.INFO)
        log.add(OOOEvent(EventKind.SETUP_FAILED, "RuntimeError", "x"), level=logging.WARNING)
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ooo_wrap"]
    assert records == [
        (logging.INFO, "bypassed/disabled: inline"),
        (logging.WARNING, "setup_failed/RuntimeError: x"),
    ]


def test_log_counts_exactly_under_concurrent_adds() -> None:
    log = EventLog(capacity=4)
    event = OOOEvent(EventKind.BYPASSED, "disabled", "inline")

    def add_many() -> None:
        for _ in range(2_000):
            log.add(event)

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (merged,) = log.snapshot()
    assert merged.count == 8_000
