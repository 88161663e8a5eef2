"""Virtual streams and events on the CPU, so the real hooks can run without a GPU."""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "SimulatedBackend",
    "SimulatedClock",
    "StreamCall",
    "TimingMark",
    "VirtualEvent",
    "VirtualStream",
]


@dataclass(frozen=True)
class VirtualStream:
    """A simulated stream; id 0 is the default stream every thread starts on."""

    id: int

    def __str__(self) -> str:
        return "default" if self.id == 0 else f"side{self.id}"


@dataclass(frozen=True)
class VirtualEvent:
    """A simulated event: marks the work queued on ``stream`` when it was last recorded.

    Recording it again on ``stream`` moves it, as a CUDA event: waits queued before keep
    the point they saw, and a wait queued after sees the new one."""

    id: int
    stream: VirtualStream

    def __str__(self) -> str:
        return f"event{self.id}@{self.stream}"


@dataclass(frozen=True, slots=True)  # one per backend call: the log holds many
class StreamCall:
    """One call the scheduler made on the backend.

    Attributes:
        op: the backend method: ``current_stream``, ``new_stream``, ``set_stream``,
            ``record_event``, ``wait_event`` or ``record_stream`` (``is_capturing`` is a
            query of the simulation's own flag and is not logged); with a ``step_time``
            clock also ``record_timing_event`` and ``synchronize``.
        stream: the stream it acted on or returned.
        event: the event recorded or waited on, if any.
        tensor: ``dtype[shape]`` of the tensor passed to ``record_stream``, if any.
        thread: name of the calling thread.
    """

    op: str
    stream: VirtualStream
    event: VirtualEvent | None = None
    tensor: str | None = None
    thread: str = ""

    def __str__(self) -> str:
        extra = " ".join(str(x) for x in (self.event, self.tensor) if x is not None)
        return f"{self.op}({self.stream}{', ' + extra if extra else ''})"


DEFAULT_STREAM = VirtualStream(0)

StepTime = Callable[[Sequence[StreamCall]], float]


@dataclass(frozen=True)
class TimingMark:
    """A simulated timing event: ``ms`` is its time on the simulated clock."""

    id: int
    stream: VirtualStream
    ms: float


class SimulatedClock:
    """A step clock on the CPU: the time between two marks is ``step_time(calls)``, given
    the backend calls logged between them."""

    device_name = "simulated"

    def __init__(self, backend: SimulatedBackend, step_time: StepTime) -> None:
        self._backend = backend
        self._step_time = step_time
        self._ids = itertools.count(1)
        self._since: list[StreamCall] | None = None  # calls since the last mark
        self._now = 0.0

    def note(self, call: StreamCall) -> None:
        if self._since is not None:
            self._since.append(call)

    def mark(self, stream: VirtualStream) -> TimingMark:
        if self._since is not None:
            self._now += float(self._step_time(tuple(self._since)))
        self._since = []
        mark = TimingMark(next(self._ids), stream, self._now)
        self._backend._call("record_timing_event", stream)
        return mark

    def done(self, mark: TimingMark) -> bool:
        return True  # the simulation has no device running behind the host

    def synchronize(self, mark: TimingMark) -> None:
        self._backend._call("synchronize", mark.stream)

    def elapsed_ms(self, start: TimingMark, end: TimingMark) -> float:
        return end.ms - start.ms


class SimulatedBackend:
    """A :class:`~ooo_wrap._runtime.backend.Backend` of virtual streams for CPU models.

    Each thread has its own current stream (the default stream until it sets another),
    as on CUDA. Every call is appended to :attr:`log`; only the latest ``log_size`` calls
    are kept unless ``keep_all=True``. Ops still run eagerly on the CPU: the simulation
    orders nothing, it records what the scheduler asked for so tests (and the race
    checker) can verify it.

    ``step_time`` gives it a clock, so that ``OOOModule(..., tune=...)`` can time steps:
    ``step_time(calls)`` returns the milliseconds between two consecutive timing marks,
    given the calls logged between them (a test can make steps that use side streams
    faster or slower). Without it the backend cannot time, and ``tune="auto"`` does not
    tune.

    Example::

        >>> backend = SimulatedBackend()
        >>> model = ooo_wrap.OOOModule(cpu_model, backend=backend)
        >>> model(x).sum().backward()
        >>> [str(call) for call in backend.log][:3]
    """

    name = "simulated"

    def __init__(
        self, *, keep_all: bool = False, log_size: int = 10_000, step_time: StepTime | None = None
    ) -> None:
        self._log: collections.deque[StreamCall] = collections.deque(
            maxlen=None if keep_all else log_size
        )
        self._step_time = step_time
        self._clock = None if step_time is None else SimulatedClock(self, step_time)
        self._ids = itertools.count(1)
        self._event_ids = itertools.count(1)
        self._local = threading.local()
        self._capturing: set[VirtualStream] = set()

    def __reduce__(self) -> tuple[Any, ...]:
        # Virtual streams are not data: a pickled backend loads as a fresh one (empty log,
        # same log settings), so a pickled wrapped model loads and runs on the CPU.
        return (_fresh_backend, (self._log.maxlen, self._step_time))

    @property
    def log(self) -> tuple[StreamCall, ...]:
        """The recorded calls, oldest first."""
        return tuple(self._log)

    def clear_log(self) -> None:
        """Forget the recorded calls."""
        self._log.clear()

    def _call(
        self,
        op: str,
        stream: VirtualStream,
        event: VirtualEvent | None = None,
        tensor: str | None = None,
    ) -> None:
        call = StreamCall(op, stream, event, tensor, threading.current_thread().name)
        self._log.append(call)
        if self._clock is not None:
            self._clock.note(call)

    # --- Backend protocol -------------------------------------------------------------

    def unsupported_reason(self, device: torch.device) -> str | None:
        return None

    def new_stream(self, device: torch.device) -> VirtualStream:
        stream = VirtualStream(next(self._ids))
        self._call("new_stream", stream)
        return stream

    def current_stream(self, device: torch.device | None = None) -> VirtualStream:
        """The calling thread's current virtual stream."""
        stream = self._peek_stream()
        self._call("current_stream", stream)
        return stream

    def set_stream(self, stream: VirtualStream) -> None:
        self._local.stream = stream
        self._call("set_stream", stream)

    def record_event(
        self, stream: VirtualStream, event: VirtualEvent | None = None
    ) -> VirtualEvent:
        # A re-recorded event is the same event, as on CUDA: it now marks the new point,
        # waits queued before keep the point they saw, and a wait queued after sees the
        # new one (a join left pending on a reused event would wait on a later record).
        if event is None or event.stream != stream:
            event = VirtualEvent(next(self._event_ids), stream)
        self._call("record_event", stream, event)
        return event

    def wait_event(self, stream: VirtualStream, event: VirtualEvent) -> None:
        self._call("wait_event", stream, event)

    def record_stream(self, tensor: torch.Tensor, stream: VirtualStream) -> None:
        description = f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
        self._call("record_stream", stream, tensor=description)

    def is_capturing(self, stream: VirtualStream) -> bool:
        return stream in self._capturing

    def step_clock(self, device: torch.device) -> SimulatedClock | None:
        """The clock ``step_time`` gives, or ``None`` (this backend cannot time steps)."""
        return self._clock

    # --- unlogged access, for the race checker's model of the autograd engine ---------

    def _peek_stream(self) -> VirtualStream:
        stream: VirtualStream = getattr(self._local, "stream", DEFAULT_STREAM)
        return stream

    def _put_stream(self, stream: VirtualStream) -> None:
        self._local.stream = stream

    # --- test helpers -----------------------------------------------------------------

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Pretend the calling thread's current stream is recording a graph capture.

        Only :meth:`is_capturing` changes; a ``DetectingBackend`` inside ``detect()``
        also enforces the rules of a CUDA stream capture.
        """
        stream = self._peek_stream()
        self._capturing.add(stream)
        try:
            yield
        finally:
            self._capturing.discard(stream)


def _fresh_backend(log_size: int | None, step_time: StepTime | None = None) -> SimulatedBackend:
    """A new :class:`SimulatedBackend` with the given log bound (``None``: keep all)."""
    if log_size is None:
        return SimulatedBackend(keep_all=True, step_time=step_time)
    return SimulatedBackend(log_size=log_size, step_time=step_time)
