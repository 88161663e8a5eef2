"""Happens-before bookkeeping for virtual streams, as the CUDA Stream Sanitizer keeps it.

Pure data: streams are any hashable ids and storages plain ints, so tests can drive it
with fake ids. Each stream has a vector clock (its own op count plus, per other stream,
the latest op of that stream it is known to run after); recording an event snapshots a
clock and waiting on it merges the snapshot. Per storage it keeps the writes and, per
stream, the reads that nothing later has covered, each with the byte range it touched,
and which streams the allocator was told about.

Byte ranges: an access covers the bytes from its tensor's first to its last element, so
writes to disjoint slices (the two halves of a buffer) do not conflict, and overlapping
ones do. A strided view that interleaves with another (column halves of a row-major
matrix) spans bytes the other uses: one range per access keeps the bookkeeping small,
at the price of reporting such pairs, as the CUDA Stream Sanitizer (whole storages) does.
"""

from __future__ import annotations

import sys
from collections.abc import Hashable, KeysView, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from .._events import ValueEnum

__all__ = [
    "WHOLE",
    "Access",
    "AllocatorHazard",
    "Clock",
    "OpRecord",
    "Phase",
    "Race",
    "RaceKind",
    "StorageId",
    "StreamId",
    "StreamTracker",
]

StreamId: TypeAlias = Hashable
StorageId: TypeAlias = int
Clock: TypeAlias = Mapping[StreamId, int]
Span: TypeAlias = tuple[int, int]  # bytes [start, end) of a storage
WHOLE: Span = (0, sys.maxsize)
Phase: TypeAlias = Literal["forward", "backward", "step"]


class RaceKind(ValueEnum):
    """How two unordered accesses to one storage conflict."""

    READ_AFTER_WRITE = "read-after-write"
    WRITE_AFTER_READ = "write-after-read"
    WRITE_AFTER_WRITE = "write-after-write"


@dataclass(frozen=True)
class Access:
    """One op's read or write of one tensor on a virtual stream.

    Attributes:
        stream: the virtual stream, as ``str(stream)`` (``default``, ``side1``, ...).
        op: the aten op (``aten.mm.default``) or a helper's name (``host_read``).
        stage: the stage running the op (forward) or whose node it is (backward), if any.
        phase: ``forward``, ``backward``, or ``step`` (after backward: optimizer, host).
        shape: the tensor's shape.
        dtype: the tensor's dtype without the ``torch.`` prefix.
        is_write: whether the op writes the tensor.
        seq: the op's position among all recorded ops.
    """

    stream: str
    op: str
    stage: str | None
    phase: Phase
    shape: tuple[int, ...]
    dtype: str
    is_write: bool
    seq: int

    def __str__(self) -> str:
        verb = "write" if self.is_write else "read"
        where = f"{self.phase}" + (f", stage {self.stage!r}" if self.stage else "")
        return f"{verb} by {self.op} on {self.stream} ({where}) of {self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Race:
    """Two accesses to one storage, on different streams, with no event ordering them."""

    kind: RaceKind
    earlier: Access
    later: Access

    def __str__(self) -> str:
        return f"{self.kind}: {self.later}\n    unordered with {self.earlier}"


@dataclass(frozen=True)
class AllocatorHazard:
    """A use on a stream the allocator was never told about (no ``record_stream``).

    When the tensor is freed, its block goes back to ``allocated_on``'s pool and may be
    reused there while ``access.stream`` still reads or writes it.
    """

    access: Access
    allocated_on: str

    def __str__(self) -> str:
        return (
            f"{self.access} without record_stream({self.access.stream}); "
            f"it was allocated on {self.allocated_on}"
        )


@dataclass(frozen=True)
class OpRecord:
    """One recorded op, for the per-stream counts and the trace.

    ``cost_us`` is the op's estimated device time (0: no kernel) and ``clock`` its
    stream's vector clock once the op was counted, as ``(stream_index, ops)`` pairs: what
    the trace lays out on its virtual time axis; ``occupancy`` the fraction of the GPU its
    kernel fills (concurrent kernels share the GPU by it).
    """

    seq: int
    stream: str
    stream_index: int
    op: str
    stage: str | None
    phase: Phase
    cost_us: float = 0.0
    clock: tuple[tuple[int, int], ...] = ()
    occupancy: float = 1.0


@dataclass
class _Use:
    stream: StreamId
    time: int
    access: Access
    span: Span


@dataclass
class _StorageState:
    allocated_on: StreamId
    long_lived: bool = False
    recorded: set[StreamId] = field(default_factory=set)
    reported: set[StreamId] = field(default_factory=set)
    writes: list[_Use] = field(default_factory=list)
    reads: dict[StreamId, list[_Use]] = field(default_factory=dict)


class StreamTracker:
    """Vector clocks per stream and access history per storage; collects findings.

    Args:
        origin: the stream that storages first seen in :meth:`access` (made before
            tracking began) count as allocated on.

    Example::

        >>> t = StreamTracker(origin="main")
        >>> t.keep_alive(1)
        >>> def use(stream, write):
        ...     return Access(stream, "op", None, "forward", (4,), "float32", write, 0)
        >>> t.tick("side"); t.access(1, "side", use("side", True))
        >>> t.tick("main"); t.access(1, "main", use("main", False))   # no wait: a race
        >>> t.races[0].kind
        <RaceKind.READ_AFTER_WRITE: 'read-after-write'>
    """

    def __init__(self, origin: StreamId) -> None:
        self._origin = origin
        self._clocks: dict[StreamId, dict[StreamId, int]] = {}
        self._storages: dict[StorageId, _StorageState] = {}
        self._seen: set[tuple[object, ...]] = set()
        self.races: list[Race] = []
        self.hazards: list[AllocatorHazard] = []

    def tick(self, stream: StreamId) -> int:
        """Count one more op on ``stream``; returns its time on the stream's own clock."""
        clock = self._clocks.setdefault(stream, {})
        clock[stream] = clock.get(stream, 0) + 1
        return clock[stream]

    def snapshot(self, stream: StreamId) -> Clock:
        """The clock an event recorded on ``stream`` now carries."""
        return dict(self._clocks.get(stream, {}))

    def wait(self, stream: StreamId, snapshot: Clock) -> None:
        """Later ops on ``stream`` run after everything ``snapshot`` covers."""
        clock = self._clocks.setdefault(stream, {})
        for other, time in snapshot.items():
            if clock.get(other, 0) < time:
                clock[other] = time

    @property
    def streams(self) -> KeysView[StreamId]:
        """The streams with a clock (every stream that ran an op or waited)."""
        return self._clocks.keys()

    def allocate(self, storage: StorageId, stream: StreamId) -> None:
        """A fresh block for ``storage`` on ``stream``: forget what its address held before."""
        self._storages[storage] = _StorageState(allocated_on=stream)

    def allocated_on(self, storage: StorageId) -> StreamId:
        """The stream whose pool ``storage``'s block belongs to."""
        state = self._storages.get(storage)
        return self._origin if state is None else state.allocated_on

    def forget(self, storage: StorageId) -> None:
        """``storage`` was freed: its address holds nothing until something allocates it."""
        self._storages.pop(storage, None)

    @property
    def storages(self) -> KeysView[StorageId]:
        """The storages with a history (live, or made before tracking and never freed)."""
        return self._storages.keys()

    def keep_alive(self, storage: StorageId) -> None:
        """Mark ``storage`` as never freed while tracked (parameters, buffers, grads)."""
        self._state(storage).long_lived = True

    def record_stream(self, storage: StorageId, stream: StreamId) -> None:
        """The allocator was told that ``stream`` uses ``storage``."""
        self._state(storage).recorded.add(stream)

    def access(
        self, storage: StorageId, stream: StreamId, access: Access, span: Span = WHOLE
    ) -> None:
        """Check one access (of the bytes ``span``) against the storage's history, then add
        it to the history.

        Call :meth:`tick` for the op first: the access happens at the stream's current time.
        """
        if span[0] >= span[1]:
            return  # no bytes: nothing to conflict with
        state = self._state(storage)
        clock = self._clocks.setdefault(stream, {})
        now = _Use(stream, clock.get(stream, 0), access, span)
        if (
            stream != state.allocated_on
            and stream not in state.recorded
            and not state.long_lived
            and stream not in state.reported
        ):
            state.reported.add(stream)
            self._hazard(AllocatorHazard(access, str(state.allocated_on)))
        if access.is_write:
            for reads in state.reads.values():
                for read in reads:
                    if _overlap(read.span, span) and not _ordered(read, clock, stream):
                        self._race(RaceKind.WRITE_AFTER_READ, read.access, access)
            self._check_writes(state, now, clock, RaceKind.WRITE_AFTER_WRITE)
            # What this write covers, later accesses need not be checked against.
            state.writes = [w for w in state.writes if not _covers(span, w.span)]
            state.writes.append(now)
            for other in list(state.reads):
                kept = [r for r in state.reads[other] if not _covers(span, r.span)]
                if kept:
                    state.reads[other] = kept
                else:
                    del state.reads[other]
        else:
            self._check_writes(state, now, clock, RaceKind.READ_AFTER_WRITE)
            # An earlier read on this stream that this one covers is ordered before it.
            reads = state.reads.get(stream, [])
            state.reads[stream] = [r for r in reads if not _covers(span, r.span)] + [now]

    def _check_writes(self, state: _StorageState, now: _Use, clock: Clock, kind: RaceKind) -> None:
        for write in state.writes:
            if _overlap(write.span, now.span) and not _ordered(write, clock, now.stream):
                self._race(kind, write.access, now.access)

    def _state(self, storage: StorageId) -> _StorageState:
        state = self._storages.get(storage)
        if state is None:
            state = self._storages[storage] = _StorageState(allocated_on=self._origin)
        return state

    def _race(self, kind: RaceKind, earlier: Access, later: Access) -> None:
        # A loop repeats the same conflict every iteration: report each distinct one once.
        key = (kind, _site(earlier), _site(later))
        if key not in self._seen:
            self._seen.add(key)
            self.races.append(Race(kind, earlier, later))

    def _hazard(self, hazard: AllocatorHazard) -> None:
        key = ("hazard", _site(hazard.access), hazard.allocated_on)
        if key not in self._seen:
            self._seen.add(key)
            self.hazards.append(hazard)


def _overlap(a: Span, b: Span) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _covers(outer: Span, inner: Span) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def _ordered(use: _Use, clock: Mapping[StreamId, int], stream: StreamId) -> bool:
    """Whether ``use`` happens before the next op on ``stream`` (whose clock is given)."""
    return use.stream == stream or clock.get(use.stream, 0) >= use.time


def _site(access: Access) -> tuple[object, ...]:
    return (
        access.stream,
        access.op,
        access.stage,
        access.phase,
        access.shape,
        access.dtype,
        access.is_write,
    )
