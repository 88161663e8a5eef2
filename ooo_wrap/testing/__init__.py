"""Tools to exercise and verify ooo_wrap without a GPU."""

from ._simulated import SimulatedBackend, StreamCall, VirtualEvent, VirtualStream

__all__ = ["SimulatedBackend", "StreamCall", "VirtualEvent", "VirtualStream"]
