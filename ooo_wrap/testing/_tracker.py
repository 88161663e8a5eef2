"""Happens-before bookkeeping for virtual streams, as the CUDA Stream Sanitizer keeps it.

Pure data: streams are any hashable ids and storages plain ints, so tests can drive it
with fake ids. Each stream has a vector clock (its own op count plus, per other stream,
the latest op of that stream it is known to run after); recording an event snapshots a
clock and waiting on it merges the snapshot. Per storage it keeps the last write and the
latest read per stream since, and which streams the allocator was told about.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

__all__ = [
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
Phase: TypeAlias = Literal["forward", "backward", "step"]


class RaceKind(enum.Enum):
    """How two unordered accesses to one storage conflict."""

    READ_AFTER_WRITE = "read-after-write"
    WRITE_AFTER_READ = "write-after-read"
    WRITE_AFTER_WRITE = "write-after-write"

    def __str__(self) -> str:
        return self.value


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
    the trace lays out on its virtual time axis.
    """

    seq: int
    stream: str
    stream_index: int
    op: str
    stage: str | None
    phase: Phase
    cost_us: float = 0.0
    clock: tuple[tuple[int, int], ...] = ()


@dataclass
class _Use:
    stream: StreamId
    time: int
    access: Access


@dataclass
class _StorageState:
    allocated_on: StreamId
    long_lived: bool = False
    recorded: set[StreamId] = field(default_factory=set)
    reported: set[StreamId] = field(default_factory=set)
    last_write: _Use | None = None
    reads: dict[StreamId, _Use] = field(default_factory=dict)


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

    def allocate(self, storage: StorageId, stream: StreamId) -> None:
        """A fresh block for ``storage`` on ``stream``: forget what its address held before."""
        self._storages[storage] = _StorageState(allocated_on=stream)

    def keep_alive(self, storage: StorageId) -> None:
        """Mark ``storage`` as never freed while tracked (parameters, buffers, grads)."""
        self._state(storage).long_lived = True

    def record_stream(self, storage: StorageId, stream: StreamId) -> None:
        """The allocator was told that ``stream`` uses ``storage``."""
        self._state(storage).recorded.add(stream)

    def access(self, storage: StorageId, stream: StreamId, access: Access) -> None:
        """Check one access against the storage's history, then add it to the history.

        Call :meth:`tick` for the op first: the access happens at the stream's current time.
        """
        state = self._state(storage)
        clock = self._clocks.setdefault(stream, {})
        now = _Use(stream, clock.get(stream, 0), access)
        if (
            stream != state.allocated_on
            and stream not in state.recorded
            and not state.long_lived
            and stream not in state.reported
        ):
            state.reported.add(stream)
            self._hazard(AllocatorHazard(access, str(state.allocated_on)))
        last = state.last_write
        if access.is_write:
            for read in state.reads.values():
                if not _ordered(read, clock, stream):
                    self._race(RaceKind.WRITE_AFTER_READ, read.access, access)
            if last is not None and not _ordered(last, clock, stream):
                self._race(RaceKind.WRITE_AFTER_WRITE, last.access, access)
            state.last_write = now
            state.reads.clear()
        else:
            if last is not None and not _ordered(last, clock, stream):
                self._race(RaceKind.READ_AFTER_WRITE, last.access, access)
            state.reads[stream] = now

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
