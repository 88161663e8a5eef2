"""The rules a CUDA stream capture enforces, checked on virtual streams.

A real capture (``torch.cuda.graph``) records the work queued on the capturing stream
into a graph instead of running it, and CUDA refuses what the graph could not replay:

1. Joining: a stream takes part only once it waits on an event recorded on a stream
   that takes part, during this capture (the fork). Work, an event record or a wait on
   any other stream while the capture is underway would run once, now, and never be
   replayed (or, in CUDA's default mode, invalidate the capture); a wait on an event
   recorded before the capture crosses its boundary (``cudaErrorStreamCaptureIsolation``).
2. Rejoining: every stream that joined must be waited on by the origin stream before
   the capture ends (``cudaErrorStreamCaptureUnjoined``).
3. No host syncs: the host cannot read a tensor or wait for the device inside a capture
   (nothing has run yet); nor can it run an op whose output size (or Python result)
   depends on the data, such as ``nonzero`` or boolean-mask indexing, or whose CUDA
   kernel reads a result on the host, which waits for the device on a GPU (the table
   ``_ops.HOST_SYNCS``; host reads that are no aten op on the CPU, such as ``.tolist()``
   or printing, are seen by ``_host.py``).

Joining is tracked with the detector's vector clocks: at the start a mark (a pseudo
stream of its own, never an op's) enters the origin's clock, and events and waits carry
it on, the autograd engine's syncs included. A stream has joined exactly when its clock
holds the mark. Rule 2 is checked as clocks show it: the origin's clock at the end must
cover the last op each joined stream ran during the capture (a stream that joined and
ran nothing leaves nothing to cover).

``record_stream`` needs no rule of its own: it stays required under capture, and a use
without it is an allocator hazard, reported as in eager mode (inside a capture the block
would be reused within the graph, a race in every replay).

A broken rule raises :class:`CaptureError` at once, as CUDA fails the call (or the end of
the capture): the traceback points at the offending code, and nothing after it would mean
what it means in a replay.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from .._errors import OOOError
from ._simulated import VirtualStream
from ._tracker import Clock, StreamTracker

__all__ = ["CaptureError", "CaptureHost", "SimulatedCapture", "simulated_capture"]

_ids = itertools.count(1)


class CaptureError(OOOError):
    """Simulated graph capture: the code broke a rule that a CUDA stream capture enforces."""


@dataclass(frozen=True)
class _Mark:
    """The pseudo stream whose clock entry says "ordered after this capture began"."""

    id: int


class SimulatedCapture:
    """One simulated capture underway on ``origin``: checks each use of a stream.

    Args:
        tracker: the detector's vector clocks.
        origin: the stream the capture was begun on.
    """

    def __init__(self, tracker: StreamTracker, origin: VirtualStream) -> None:
        self.origin = origin
        self._tracker = tracker
        self._mark = _Mark(next(_ids))
        # Each stream's own op count as the capture begins: later ops are captured.
        self._start = {s: tracker.snapshot(s).get(s, 0) for s in tracker.streams}
        tracker.tick(self._mark)
        tracker.wait(origin, tracker.snapshot(self._mark))

    def joined(self, stream: VirtualStream) -> bool:
        """Whether ``stream`` takes part in the capture (the origin always does)."""
        return self._mark in self._tracker.snapshot(stream)

    def use(self, stream: VirtualStream, what: str) -> None:
        """``stream`` runs ``what`` (an op, an event record): it must have joined."""
        if not self.joined(stream):
            raise CaptureError(
                f"{what} on {stream} during a graph capture begun on {self.origin}, but "
                f"{stream} never joined the capture: on a GPU this would run once now and "
                "never be replayed. Make it wait on an event recorded on a capturing "
                "stream after the capture began (the scheduler's fork does)"
            )

    def op(self, op: str, stream: VirtualStream, host_sync: str | None) -> None:
        """The op ``op`` runs on ``stream``; ``host_sync``: why the host waits for it on a
        GPU (``_ops.host_sync``), if it does."""
        if host_sync is not None:
            raise CaptureError(
                f"{op} during a graph capture begun on {self.origin}: {host_sync}, so on a "
                "GPU the host waits for the device, which a capture cannot do (nothing has "
                "run yet). Keep it out of the captured region: read results after replaying "
                "the graph; for data-dependent ops (nonzero, boolean-mask indexing, unique, "
                "routing by a data-dependent count) use fixed-size forms (nonzero_static, "
                "index with integer tensors, a fixed capacity)"
            )
        self.use(stream, f"op {op}")

    def wait(self, stream: VirtualStream, event: object, snapshot: Clock | None) -> None:
        """``stream`` waits on ``event``, which carries ``snapshot`` (``None``: recorded
        before detection began)."""
        if snapshot is not None and self._mark in snapshot:
            return  # the fork: recorded on a capturing stream during this capture
        if self.joined(stream):
            raise CaptureError(
                f"{stream} waits on {event} during a graph capture begun on "
                f"{self.origin}, but the event was recorded outside the capture: a "
                "dependency across the capture's boundary. Re-record the event inside it"
            )
        self.use(stream, f"a wait on {event}")

    def end(self) -> None:
        """The capture ends: every stream that joined must have rejoined the origin."""
        tracker = self._tracker
        at_end = tracker.snapshot(self.origin)
        unjoined: list[VirtualStream] = []
        for stream in tracker.streams:
            if not isinstance(stream, VirtualStream) or stream == self.origin:
                continue
            last = tracker.snapshot(stream).get(stream, 0)
            captured = self.joined(stream) and last > self._start.get(stream, 0)
            if captured and at_end.get(stream, 0) < last:
                unjoined.append(stream)
        if unjoined:
            names = ", ".join(str(s) for s in sorted(unjoined, key=lambda s: s.id))
            raise CaptureError(
                f"a graph capture begun on {self.origin} ended with {names} not rejoined: "
                f"{self.origin} never waited on an event recorded after its last op "
                "(CUDA: cudaErrorStreamCaptureUnjoined). Join every side stream back "
                "before the capture ends"
            )


class CaptureHost(Protocol):
    """What a simulated capture needs from the detection it runs in (``_detection.Detection``,
    which imports this module: a protocol keeps the import one-way)."""

    tracker: StreamTracker
    capture: SimulatedCapture | None
    captures: int

    def stream_now(self) -> VirtualStream:
        """The calling thread's current virtual stream."""
        ...


@contextlib.contextmanager
def simulated_capture(host: CaptureHost) -> Iterator[None]:
    """A capture begun on the current stream for the block; its end is checked unless the
    block raised (the error raised inside says what went wrong)."""
    if host.capture is not None:
        raise CaptureError(
            f"a graph capture is already underway on {host.capture.origin}; end it before "
            "beginning another"
        )
    host.capture = capture = SimulatedCapture(host.tracker, host.stream_now())
    try:
        yield
    finally:
        host.capture = None
    capture.end()
    host.captures += 1
