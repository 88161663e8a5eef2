"""Run code on virtual streams under the race detector: ``detect()`` and ``host_read()``.

What the block saw is a ``_detection.Detection``. Inside ``detect()``,
``backend.capturing()`` simulates a CUDA graph capture whose rules ``_capture.py`` checks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .._compat import checker_names_found
from .._errors import OOOError
from .._planner.cost import H200, ReferenceGPU
from .._planner.intercept import OpInterceptor, intercept_new_threads
from ._capture import simulated_capture
from ._detection import Detection
from ._host import HostReads
from ._ops import storage_key, written_keys
from ._simulated import SimulatedBackend, StepTime, VirtualEvent, VirtualStream

__all__ = ["DetectingBackend", "detect", "host_read"]

_active: contextvars.ContextVar[Detection | None] = contextvars.ContextVar(
    "ooo_wrap_detection", default=None
)


class DetectingBackend(SimulatedBackend):
    """A :class:`SimulatedBackend` whose events, waits and ``record_stream`` calls feed
    the race detector of the :func:`detect` block it is used in.

    Outside a ``detect()`` block it behaves exactly like :class:`SimulatedBackend`.

    Example::

        >>> backend = DetectingBackend()
        >>> model = ooo_wrap.OOOModule(cpu_model, backend=backend)
        >>> with detect(backend) as found:
        ...     model(x).sum().backward()
        >>> found.races, found.allocator_hazards
    """

    def __init__(
        self, *, keep_all: bool = False, log_size: int = 10_000, step_time: StepTime | None = None
    ) -> None:
        super().__init__(keep_all=keep_all, log_size=log_size, step_time=step_time)
        self._detection: Detection | None = None

    def record_event(
        self, stream: VirtualStream, event: VirtualEvent | None = None
    ) -> VirtualEvent:
        detection = self._detection
        if detection is not None:
            detection.flush_tags()
        if detection is not None and detection.capture is not None:
            detection.capture.use(stream, "an event record")
        event = super().record_event(stream, event)
        if detection is not None:
            detection._events[event.id] = detection.tracker.snapshot(stream)
        return event

    def wait_event(self, stream: VirtualStream, event: VirtualEvent) -> None:
        detection = self._detection
        # An event recorded before detection began orders nothing the detector saw.
        snapshot = None if detection is None else detection._events.get(event.id)
        if detection is not None and detection.capture is not None:
            detection.capture.wait(stream, event, snapshot)
        super().wait_event(stream, event)
        if detection is not None and snapshot is not None:
            detection.tracker.wait(stream, snapshot)

    def record_stream(self, tensor: torch.Tensor, stream: VirtualStream) -> None:
        super().record_stream(tensor, stream)
        key = storage_key(tensor)
        if self._detection is not None:
            self._detection.flush_tags()
            if key is not None:
                self._detection.tracker.record_stream(key, stream)

    def is_capturing(self, stream: VirtualStream) -> bool:
        # As CUDA answers: a stream that joined a capture is capturing too.
        capture = None if self._detection is None else self._detection.capture
        return super().is_capturing(stream) or (capture is not None and capture.joined(stream))

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Simulate a graph capture begun on the calling thread's current stream.

        Inside a :func:`detect` block the rules of a CUDA stream capture are enforced
        (``ooo_wrap/testing/_capture.py``): every stream used must have joined through an
        event recorded during the capture, every joined stream must rejoin before the
        end, and no host read may happen inside; a broken rule raises
        :class:`~ooo_wrap.testing.CaptureError`. Outside one it only makes
        :meth:`is_capturing` true for that stream.

        Example::

            >>> with detect(backend):
            ...     with backend.capturing():
            ...         model(static_x).sum().backward()
        """
        detection = self._detection
        if detection is None:
            with super().capturing():
                yield
            return
        with super().capturing(), simulated_capture(detection):
            yield


@contextlib.contextmanager
def detect(
    backend: DetectingBackend | None = None,
    *,
    keep_alive: Iterable[torch.Tensor | nn.Module] = (),
    gpu: ReferenceGPU = H200,
) -> Iterator[Detection]:
    """Run a block on virtual streams under the race detector.

    Every aten op in the block (forward, and backward inside the autograd engine) is
    attributed to a virtual stream and checked against what the backend's events and
    waits order; ``record_stream`` calls and the engine's own syncs are modelled.

    Args:
        backend: the backend the code under test switches streams on; a fresh one if
            ``None`` (reach it as ``detection.backend``).
        keep_alive: tensors or modules whose memory is never freed mid-step (see
            :meth:`Detection.keep_alive`).
        gpu: the reference GPU the recorded ops' device times are estimated on.

    Yields:
        the :class:`Detection`, whose ``races`` and ``allocator_hazards`` are final
        once the block exits.

    Raises:
        OOOError: this torch lacks a private PyTorch name the detector models the
            autograd engine with (named in the message; docs/torch-versions.md).

    Example::

        >>> with detect() as found:
        ...     b = found.backend
        ...     main, side = b.current_stream(), b.new_stream(torch.device("cpu"))
        ...     x = torch.ones(4)
        ...     b.wait_event(side, b.record_event(main)); b.record_stream(x, side)
        ...     b.set_stream(side); y = x * 2; b.set_stream(main)
        ...     b.record_stream(y, main)
        ...     host_read(y)                      # no join: side may still write y
        >>> [str(r.kind) for r in found.races]
        ['read-after-write']
    """
    missing = checker_names_found()
    if missing is not None:
        raise OOOError(
            f"the race checker needs {missing}, a private PyTorch name this torch "
            f"({torch.__version__}) lacks; run it on a torch that has it (see "
            "docs/torch-versions.md)"
        )
    backend = backend if backend is not None else DetectingBackend()
    if backend._detection is not None:
        raise RuntimeError("this backend is already inside a detect() block")
    detection = Detection(backend, gpu)
    detection.keep_alive(*keep_alive)
    backend._detection = detection
    token = _active.set(detection)
    try:
        with (
            OpInterceptor(detection._on_op, written_keys),
            intercept_new_threads(detection._on_op, written_keys),
            HostReads(detection._host_read, detection._device_checks),
        ):
            yield detection
            detection._engine.flush()
    finally:
        detection._engine.close()
        detection._close()
        backend._detection = None
        _active.reset(token)


def host_read(tensor: torch.Tensor) -> torch.Tensor:
    """Model the host reading ``tensor`` (a synchronize before reading it, or a read the
    detector cannot see); inside a simulated graph capture it is refused.

    The copy runs on the current stream, so the read must be ordered after every write.
    ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")`` and printing need
    no helper on the thread that entered :func:`detect`: the detector sees them. Outside
    :func:`detect` this does nothing. Returns ``tensor``.

    Example::

        >>> loss = model(x).sum()
        >>> host_read(loss)  # before handing loss to code the detector cannot see
    """
    detection = _active.get()
    if detection is not None:
        detection._host_read(tensor)
    return tensor
