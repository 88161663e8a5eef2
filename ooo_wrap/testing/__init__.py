"""Tools to exercise and verify ooo_wrap without a GPU.

``check(model, *inputs)`` trains a copy of a model on virtual streams and reports every
stream race (``capture=True``: its last step under a simulated CUDA graph capture);
``detect()`` runs hand-written multi-stream code under the same detector, and
``backend.capturing()`` inside it simulates a capture.
"""

from ._capture import CaptureError
from ._check import check
from ._detect import DetectingBackend, detect, host_read
from ._detection import Detection
from ._report import CheckFailed, CheckReport, ParityEntry, StepEstimate, StreamOps
from ._simulated import SimulatedBackend, StreamCall, VirtualEvent, VirtualStream
from ._tracker import Access, AllocatorHazard, OpRecord, Race, RaceKind

__all__ = [
    "Access",
    "AllocatorHazard",
    "CaptureError",
    "CheckFailed",
    "CheckReport",
    "DetectingBackend",
    "Detection",
    "OpRecord",
    "ParityEntry",
    "Race",
    "RaceKind",
    "SimulatedBackend",
    "StepEstimate",
    "StreamCall",
    "StreamOps",
    "VirtualEvent",
    "VirtualStream",
    "check",
    "detect",
    "host_read",
]
