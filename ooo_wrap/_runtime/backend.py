"""The stream primitives the scheduler needs, and their implementation on real accelerators.

This is the only module that touches device streams and events. It uses the
device-generic ``torch.Stream`` / ``torch.Event`` / ``torch.accelerator`` API, so CUDA,
ROCm and XPU share one code path.

A backend that can time training steps also has ``step_clock(device)``, returning a
:class:`StepClock` (timing events read without a per-step host sync) or ``None``; it is
optional, so a backend written against :class:`Backend` alone keeps working and simply
cannot time (:func:`clock_of`). Likewise ``live_bytes(device)``, the bytes tensors occupy
on the device now, which bounds how far the weight-gradient split may lag
(:func:`live_bytes_of`: 0 where the backend cannot tell, so the split does not lag).
"""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

import torch

from .._compat import device_live_bytes, stream_is_capturing

__all__ = [
    "AcceleratorBackend",
    "AcceleratorClock",
    "Backend",
    "Event",
    "StepClock",
    "Stream",
    "clock_of",
    "live_bytes_of",
]

# Streams and events are opaque to the scheduler: it only hands them back to its backend.
Stream: TypeAlias = Any
Event: TypeAlias = Any
Mark: TypeAlias = Any  # a timing event of a StepClock


class Backend(Protocol):
    """What the scheduler asks of a device: streams, events, waits and allocator marks."""

    name: str

    def unsupported_reason(self, device: torch.device) -> str | None:
        """``None`` if stages on ``device`` can use side streams, else a short reason."""
        ...

    def new_stream(self, device: torch.device) -> Stream:
        """A fresh side stream on ``device``."""
        ...

    def current_stream(self, device: torch.device) -> Stream:
        """The calling thread's current stream on ``device``."""
        ...

    def set_stream(self, stream: Stream) -> None:
        """Make ``stream`` the calling thread's current stream on its device."""
        ...

    def record_event(self, stream: Stream, event: Event | None = None) -> Event:
        """Mark all work queued on ``stream`` so far with ``event`` and return it.

        ``event`` is one this backend returned before, re-recorded (a wait already queued
        on it keeps the state it had when queued), or ``None`` for a new event.
        """
        ...

    def wait_event(self, stream: Stream, event: Event) -> None:
        """Make later work on ``stream`` wait until ``event`` has completed."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """Tell the allocator that ``stream`` uses ``tensor``'s memory."""
        ...

    def is_capturing(self, stream: Stream) -> bool:
        """Whether ``stream`` is recording a graph capture."""
        ...


class StepClock(Protocol):
    """Timing marks on a stream, compared once the device has passed them."""

    device_name: str

    def mark(self, stream: Stream) -> Mark:
        """Record a timing mark on ``stream`` now (no host synchronization)."""
        ...

    def done(self, mark: Mark) -> bool:
        """Whether the device has passed ``mark`` (a non-blocking query)."""
        ...

    def synchronize(self, mark: Mark) -> None:
        """Block the host until the device has passed ``mark``."""
        ...

    def elapsed_ms(self, start: Mark, end: Mark) -> float:
        """Milliseconds on the device from ``start`` to ``end``; both must be done."""
        ...


def clock_of(backend: Backend, device: torch.device) -> StepClock | None:
    """The backend's step clock for ``device``, or ``None`` if it cannot time steps."""
    step_clock = getattr(backend, "step_clock", None)
    if not callable(step_clock):
        return None
    clock: StepClock | None = step_clock(device)
    return clock


def live_bytes_of(backend: Backend, device: torch.device) -> int:
    """The bytes tensors occupy on ``device`` now, as the backend tells, else 0."""
    live_bytes = getattr(backend, "live_bytes", None)
    return int(live_bytes(device)) if callable(live_bytes) else 0


class AcceleratorBackend:
    """:class:`Backend` on the current accelerator (CUDA, ROCm, XPU, ...)."""

    name = "accelerator"

    def __init__(self) -> None:
        # With one device there is no other current device to put back after a stream
        # switch, so set_stream skips the device query; the count never changes in a process.
        self._single_device: bool | None = None

    def unsupported_reason(self, device: torch.device) -> str | None:
        if device.type in ("cpu", "mps"):
            return device.type
        accelerator = torch.accelerator.current_accelerator() if _has_accelerator() else None
        if accelerator is None or accelerator.type != device.type:
            return "no_accelerator"
        return None

    def new_stream(self, device: torch.device) -> Stream:
        return torch.Stream(device=device)

    def current_stream(self, device: torch.device) -> Stream:
        return torch.accelerator.current_stream(device)

    def set_stream(self, stream: Stream) -> None:
        # torch.accelerator.set_stream also switches the current device to the stream's;
        # put the caller's device back so that the only state we change is the stream.
        if self._single_device is None:
            self._single_device = torch.accelerator.device_count() == 1
        if self._single_device:
            torch.accelerator.set_stream(stream)
            return
        device_index = torch.accelerator.current_device_index()
        torch.accelerator.set_stream(stream)
        if stream.device_index != device_index:
            torch.accelerator.set_device_index(device_index)

    def record_event(self, stream: Stream, event: Event | None = None) -> Event:
        if event is None:
            return stream.record_event()
        stream.record_event(event)
        return event

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream)

    def is_capturing(self, stream: Stream) -> bool:
        return stream_is_capturing(stream)  # torch.Stream.is_capturing is newer than 2.11

    def step_clock(self, device: torch.device) -> StepClock | None:
        return AcceleratorClock(device) if self.unsupported_reason(device) is None else None

    def live_bytes(self, device: torch.device) -> int:
        return device_live_bytes(device)


class AcceleratorClock:
    """:class:`StepClock` of ``torch.Event(enable_timing=True)`` on an accelerator."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        get_name = getattr(getattr(torch, device.type, None), "get_device_name", None)
        self.device_name = str(get_name(device)) if callable(get_name) else str(device)

    def mark(self, stream: Stream) -> Mark:
        event = torch.Event(device=self._device, enable_timing=True)
        stream.record_event(event)
        return event

    def done(self, mark: Mark) -> bool:
        return bool(mark.query())

    def synchronize(self, mark: Mark) -> None:
        mark.synchronize()

    def elapsed_ms(self, start: Mark, end: Mark) -> float:
        return float(start.elapsed_time(end))


def _has_accelerator() -> bool:
    return torch.accelerator.is_available()
