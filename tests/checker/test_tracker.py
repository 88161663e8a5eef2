"""The pure happens-before bookkeeping, driven with fake stream and storage ids."""

from __future__ import annotations

from ooo_wrap.testing import Access, RaceKind
from ooo_wrap.testing._tracker import StreamTracker


def _access(stream: str, op: str, *, write: bool) -> Access:
    return Access(stream, op, None, "forward", (2,), "float32", write, 0)


def _op(tracker: StreamTracker, storage: int, stream: str, op: str, *, write: bool) -> None:
    tracker.tick(stream)
    tracker.access(storage, stream, _access(stream, op, write=write))


def test_an_event_wait_orders_a_read_after_a_write() -> None:
    ordered, racy = StreamTracker(origin="a"), StreamTracker(origin="a")
    for tracker in (ordered, racy):
        tracker.allocate(1, "a")
        tracker.record_stream(1, "b")
        _op(tracker, 1, "a", "write", write=True)
    ordered.wait("b", ordered.snapshot("a"))
    _op(ordered, 1, "b", "read", write=False)
    _op(racy, 1, "b", "read", write=False)
    assert ordered.races == [] and ordered.hazards == []
    assert [(r.kind, r.earlier.op, r.later.op) for r in racy.races] == [
        (RaceKind.READ_AFTER_WRITE, "write", "read")
    ]


def test_a_snapshot_covers_only_work_before_it() -> None:
    tracker = StreamTracker(origin="a")
    tracker.allocate(1, "a")
    tracker.record_stream(1, "b")
    snapshot = tracker.snapshot("a")  # recorded before the write
    _op(tracker, 1, "a", "write", write=True)
    tracker.wait("b", snapshot)
    _op(tracker, 1, "b", "read", write=False)
    assert [r.kind for r in tracker.races] == [RaceKind.READ_AFTER_WRITE]


def test_waits_are_transitive() -> None:
    tracker = StreamTracker(origin="a")
    tracker.keep_alive(1)
    _op(tracker, 1, "a", "write", write=True)
    tracker.wait("b", tracker.snapshot("a"))
    tracker.tick("b")
    tracker.wait("c", tracker.snapshot("b"))
    _op(tracker, 1, "c", "read", write=False)
    assert tracker.races == [] and tracker.hazards == []


def test_write_after_reads_on_two_streams_reports_the_unordered_one() -> None:
    tracker = StreamTracker(origin="a")
    tracker.keep_alive(1)
    _op(tracker, 1, "b", "read b", write=False)
    _op(tracker, 1, "c", "read c", write=False)
    tracker.wait("a", tracker.snapshot("b"))
    _op(tracker, 1, "a", "write", write=True)
    assert [(r.kind, r.earlier.op) for r in tracker.races] == [
        (RaceKind.WRITE_AFTER_READ, "read c")
    ]


def test_allocator_hazards_need_a_foreign_stream_without_record_stream() -> None:
    tracker = StreamTracker(origin="a")
    tracker.allocate(1, "a")
    tracker.allocate(2, "a")
    tracker.record_stream(2, "b")
    tracker.allocate(3, "a")
    tracker.keep_alive(3)
    for storage in (1, 2, 3):
        _op(tracker, storage, "a", "own stream", write=False)
        _op(tracker, storage, "b", "side", write=False)
    assert [(h.access.op, h.allocated_on) for h in tracker.hazards] == [("side", "a")]


def test_a_fresh_allocation_forgets_the_old_history() -> None:
    tracker = StreamTracker(origin="a")
    tracker.allocate(1, "b")
    _op(tracker, 1, "b", "old write", write=True)
    tracker.allocate(1, "a")  # the address is reused for a new tensor
    _op(tracker, 1, "a", "new read", write=False)
    assert tracker.races == [] and tracker.hazards == []


def test_each_distinct_race_is_reported_once() -> None:
    tracker = StreamTracker(origin="a")
    tracker.keep_alive(1)
    for _ in range(3):
        _op(tracker, 1, "a", "write", write=True)
        _op(tracker, 1, "b", "read", write=False)
    assert len(tracker.races) == 2  # read-after-write, and write-after-read from round two
    assert {r.kind for r in tracker.races} == {
        RaceKind.READ_AFTER_WRITE,
        RaceKind.WRITE_AFTER_READ,
    }
    assert "read-after-write: read by read on b (forward) of float32[2]" in str(tracker.races[0])


def test_a_freed_storage_is_forgotten() -> None:
    tracker = StreamTracker(origin="a")
    tracker.allocate(1, "b")
    _op(tracker, 1, "b", "old write", write=True)
    tracker.forget(1)
    assert 1 not in tracker.storages
    tracker.keep_alive(1)  # a tensor made before tracking now sits at the address
    _op(tracker, 1, "a", "new read", write=False)
    assert tracker.races == [] and tracker.hazards == []
