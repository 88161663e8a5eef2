"""What one ``detect()`` block saw, and how it sees it: each op (and host read) on its
virtual stream, checked against the events and waits that order the streams.

``_detect.py`` enters the block and feeds this record: its dispatch modes report every op
here, and the :class:`~ooo_wrap.testing.DetectingBackend` every event, wait and
``record_stream``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node

from .._planner.cost import H200, ReferenceGPU, estimate_op
from .._planner.intercept import OpArgs, OpKwargs, OpOverload
from .._tensors import tensors_in
from ._capture import SimulatedCapture
from ._engine import AccumulatorMismatch, EngineModel
from ._ops import HOST_SYNCS, TensorUse, host_sync, is_view_only, storage_key, tensor_uses
from ._simulated import SimulatedBackend, VirtualStream
from ._tracker import Access, AllocatorHazard, Clock, OpRecord, Phase, Race, StreamTracker

__all__ = ["Detection"]


class Detection:
    """What one :func:`detect` block saw: races, allocator hazards and every op.

    Attributes:
        backend: the backend whose virtual streams the block runs on.
        tracker: the happens-before bookkeeping (vector clocks, per-storage history).
        capture: the simulated graph capture underway (``backend.capturing()``), if any.
        captures: how many simulated captures ended with their rules kept.
        gpu: the reference GPU each op's device time is estimated on.
    """

    def __init__(self, backend: SimulatedBackend, gpu: ReferenceGPU = H200) -> None:
        self.backend = backend
        self.gpu = gpu
        self.tracker = StreamTracker(origin=backend._peek_stream())
        self._events: dict[int, Clock] = {}
        self._engine = EngineModel(self)
        self._records: list[OpRecord] = []
        # Stage labels pushed, innermost last, each with whether it was pushed in backward.
        self._stages: list[tuple[str, bool]] = []
        self._phase: Phase = "forward"
        # Threads started inside detect() report here too.
        self._lock = threading.RLock()
        # Per storage in the history, what forgets it when the storage is freed.
        self._watched: dict[int, weakref.finalize[Any, Any]] = {}
        # The simulated graph capture underway, and how many were completed.
        self.capture: SimulatedCapture | None = None
        self.captures = 0
        self._device_checks_now = 0  # >0: host syncs inside are device asserts on CUDA

    @property
    def races(self) -> tuple[Race, ...]:
        """Unordered cross-stream accesses, in the order found."""
        return tuple(self.tracker.races)

    @property
    def allocator_hazards(self) -> tuple[AllocatorHazard, ...]:
        """Uses on a stream the tensor's allocation was never recorded to."""
        return tuple(self.tracker.hazards)

    @property
    def ops(self) -> tuple[OpRecord, ...]:
        """Every op seen, in order, with its stream, stage and phase."""
        return tuple(self._records)

    @property
    def accumulator_mismatches(self) -> tuple[AccumulatorMismatch, ...]:
        """Gradients handed to an ``AccumulateGrad`` node on another stream than their
        producer's (what torch >= 2.9 warns of): no race, since the engine orders the
        hand-over, but the accumulation waits there. ``stale`` ones went to an accumulator
        made before the last backward ended, which an older graph kept alive from a step
        that ran on other streams; the others to a parameter two streams' stages share."""
        return tuple(self._engine.mismatches)

    @property
    def ok(self) -> bool:
        """No races and no allocator hazards."""
        return not self.tracker.races and not self.tracker.hazards

    def keep_alive(self, *objects: torch.Tensor | nn.Module) -> None:
        """Declare tensors (or a module's parameters and buffers) never freed mid-step.

        The allocator cannot reuse such memory, so using it on any stream without
        ``record_stream`` is no hazard; races on it are still reported.
        """
        for obj in objects:
            tensors = _module_tensors(obj) if isinstance(obj, nn.Module) else [obj]
            for tensor in tensors:
                key = storage_key(tensor)
                if key is not None:
                    self.tracker.keep_alive(key)

    def node_stream(self, node: Node) -> VirtualStream | None:
        """The virtual stream the engine model runs autograd ``node`` on (the stream its
        forward made it on), or ``None`` for a node it has not tagged yet (a node is
        tagged at the op after the one that made it)."""
        return self._engine.stream_of(node)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Attribute forward ops run inside the block (and their backward) to stage ``name``."""
        self._push_stage(name)
        try:
            yield
        finally:
            self._pop_stage()

    @contextlib.contextmanager
    def phase(self, name: Phase) -> Iterator[None]:
        """Label ops outside ``backward()`` run inside the block (default ``forward``)."""
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def _push_stage(self, name: str) -> None:
        self._stages.append((name, self._engine.in_backward))

    def _pop_stage(self) -> None:
        if self._stages:
            self._stages.pop()

    def flush_tags(self) -> None:
        """Tag the autograd nodes of the last op's outputs now (see ``DetectingBackend``)."""
        with self._lock:
            self._engine.flush()

    # --- EngineHost -----------------------------------------------------------------

    def stream_now(self) -> VirtualStream:
        return self.backend._peek_stream()

    def switch_stream(self, stream: VirtualStream) -> None:
        self.backend._put_stream(stream)

    # --- recording ------------------------------------------------------------------

    def _on_op(
        self,
        func: OpOverload,
        args: OpArgs,
        kwargs: OpKwargs,
        out: Any,
        before: list[int | None] | None,
    ) -> None:
        with self._lock:
            self._engine.catch_up()
            if is_view_only(func):
                # No kernel, no access: only the autograd node it may create matters.
                self._engine.created(tensors_in(out), self.stream_now(), self._stage_now())
                return
            uses = tensor_uses(func, args, kwargs, out, before)
            consumer = self._engine.accumulation_target(func, (u.key for u in uses if not u.fresh))
            if consumer is not None:
                stream, stage = consumer.stream, consumer.stage
            else:
                stream, stage = self.stream_now(), self._stage_now()
            estimate = estimate_op(func, args, kwargs, out, self.gpu)
            sync = None
            if self.capture is not None and not self._device_checks_now:
                sync = host_sync(func, args, kwargs)
            self._record(
                str(func), stream, stage, uses, estimate.device_us, sync, estimate.occupancy
            )
            self._engine.created(tensors_in(out), stream, stage)

    def _host_read(self, tensor: torch.Tensor, op: str = "host_read") -> None:
        with self._lock:
            self._engine.flush()
            key = storage_key(tensor)
            uses = [] if key is None else [TensorUse(tensor, key, is_write=False, fresh=False)]
            # The device-to-host copy, costed as the copy op it is.
            copy = torch.ops.aten._to_copy.default
            cost = estimate_op(copy, (tensor,), {}, tensor, self.gpu)
            self._record(
                op,
                self.stream_now(),
                self._stage_now(),
                uses,
                cost.device_us,
                HOST_SYNCS[op],
                cost.occupancy,
            )

    @contextlib.contextmanager
    def _device_checks(self) -> Iterator[None]:
        self._device_checks_now += 1
        try:
            yield
        finally:
            self._device_checks_now -= 1

    def _stage_now(self) -> str | None:
        stages = self._stages
        if self._engine.in_backward and not (stages and stages[-1][1]):
            # The running node's stage, unless a stage call is running inside it (a
            # checkpoint recomputing a stage in the node that unpacked first).
            return self._engine.stage
        return stages[-1][0] if stages else None

    def _record(
        self,
        op: str,
        stream: VirtualStream,
        stage: str | None,
        uses: list[TensorUse],
        cost_us: float,
        host_sync: str | None,
        occupancy: float = 1.0,
    ) -> None:
        tracker = self.tracker
        if self.capture is not None:
            self.capture.op(op, stream, host_sync)
        tracker.tick(stream)
        seq = len(self._records)
        phase: Phase = "backward" if self._engine.in_backward else self._phase
        clock = tuple(
            sorted(
                (s.id, n)
                for s, n in tracker.snapshot(stream).items()
                if isinstance(s, VirtualStream)
            )
        )
        self._records.append(
            OpRecord(seq, str(stream), stream.id, op, stage, phase, cost_us, clock, occupancy)
        )
        for use in uses:
            if use.fresh:
                tracker.allocate(use.key, stream)
            if use.key not in self._watched:
                storage = use.tensor.untyped_storage()
                self._watched[use.key] = weakref.finalize(storage, self._freed, use.key)
            tensor = use.tensor
            access = Access(
                str(stream),
                op,
                stage,
                phase,
                tuple(tensor.shape),
                str(tensor.dtype).removeprefix("torch."),
                use.is_write,
                seq,
            )
            tracker.access(use.key, stream, access, use.span)

    def _freed(self, key: int) -> None:
        # The storage's memory is going back to the allocator: a later tensor at this
        # address starts a new history (the allocator's reuse rules are what
        # record_stream and the hazards are about).
        with self._lock:
            self._watched.pop(key, None)
            self.tracker.forget(key)

    def _close(self) -> None:
        for finalizer in self._watched.values():
            finalizer.detach()
        self._watched.clear()


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]
