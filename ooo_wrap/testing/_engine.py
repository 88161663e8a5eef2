"""A model of the autograd engine's stream semantics, driven by node hooks on the CPU.

What the real engine does (``torch/csrc/autograd/engine.cpp``, ``input_buffer.cpp``), and
how each point is modelled here:

1. A node runs on the stream that was current when it was created in forward: every new
   node is tagged (``node.metadata``) with the virtual stream of the op that created it,
   and its pre-hook makes that stream current while it runs.
2. An ``AccumulateGrad`` node takes the stream current when the leaf's grad accumulator
   was created, i.e. the first op that used the leaf in this graph: an untagged node
   reached from a new node is tagged with that node's stream. If the accumulator outlives
   a step (something holds the old graph), it keeps its old tag, as the engine's does.
3. A gradient passing from a producer to a consumer node on another stream: the consumer
   (or the accumulation into its input buffer) waits on an event recorded on the producer
   when the producer finished, and the engine calls ``record_stream(consumer)`` on the
   gradient. Accumulation of several gradients runs on the consumer's stream.
4. The graph root waits on the stream that called ``backward()``.
5. At the end of ``backward()`` the caller's stream waits on every leaf stream (streams
   of nodes with no outputs, such as ``AccumulateGrad``), so the caller may read ``.grad``.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from ._ops import storage_key
from ._simulated import VirtualStream
from ._tracker import Clock, StreamTracker

__all__ = ["EngineHost", "EngineModel", "NodeTag"]

_TAG = "ooo_wrap.testing.stream"


class EngineHost(Protocol):
    """What the engine model needs from the detection that owns it."""

    tracker: StreamTracker

    def stream_now(self) -> VirtualStream:
        """The calling thread's current virtual stream (without logging a backend call)."""
        ...

    def switch_stream(self, stream: VirtualStream) -> None:
        """Make ``stream`` current, as the engine's stream guard does (not logged)."""
        ...


@dataclass(frozen=True)
class NodeTag:
    """The virtual stream (and stage) an autograd node was created on."""

    owner: int
    id: int
    stream: VirtualStream
    stage: str | None


@dataclass
class _Backward:
    """One ``backward()`` (or ``autograd.grad``) call in flight."""

    caller: VirtualStream
    start: Clock
    stage_before: str | None
    leaf_streams: set[VirtualStream] = field(default_factory=set)
    running: int = 0


class EngineModel:
    """Tags nodes as forward creates them and replays the engine's syncs in backward."""

    def __init__(self, host: EngineHost) -> None:
        self._host = host
        self._ids = itertools.count()
        self._pending: tuple[list[torch.Tensor], VirtualStream, str | None] | None = None
        self._waits: defaultdict[int, list[Clock]] = defaultdict(list)
        self._fed: set[int] = set()
        self._stack: list[_Backward] = []
        self._window: dict[int, NodeTag] = {}
        self._handles: list[RemovableHandle] = []
        self._stage: str | None = None

    @property
    def in_backward(self) -> bool:
        """Whether a backward pass is running on this thread."""
        return bool(self._stack)

    @property
    def stage(self) -> str | None:
        """The stage of the node running now (backward only)."""
        return self._stage

    def created(
        self, outputs: list[torch.Tensor], stream: VirtualStream, stage: str | None
    ) -> None:
        """An op made ``outputs`` on ``stream``; autograd sets their ``grad_fn`` after it
        returns, so they are tagged at the next op (kept alive until then)."""
        self.flush()
        if outputs:
            self._pending = (outputs, stream, stage)

    def flush(self) -> None:
        """Tag the nodes of the last op's outputs, and release them."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        outputs, stream, stage = pending
        for tensor in outputs:
            node = tensor.grad_fn
            if node is not None and self._tag(node) is None:
                self._tag_graph(node, stream, stage)

    def accumulation_target(self, keys: Iterable[int]) -> NodeTag | None:
        """The consumer node whose input buffer an op between two nodes accumulates into.

        The engine adds a second gradient for one input on the consumer's stream, after
        waiting on every producer so far: the waits are applied here, and the op is to
        be attributed to the returned node's stream.
        """
        if not self._window:
            return None
        for key in keys:
            consumer = self._window.get(key)
            if consumer is not None:
                self._apply_waits(consumer)
                return consumer
        return None

    def close(self) -> None:
        """Remove every hook this model installed and forget its state."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending = None
        self._waits.clear()
        self._window.clear()
        self._stack.clear()

    # --- tagging --------------------------------------------------------------------

    def _tag(self, node: Node) -> NodeTag | None:
        tag = _metadata(node).get(_TAG)
        return tag if isinstance(tag, NodeTag) and tag.owner == id(self) else None

    def _tag_graph(self, root: Node, stream: VirtualStream, stage: str | None) -> None:
        stack = [root]
        while stack:
            node = stack.pop()
            if self._tag(node) is not None:
                continue
            self._tag_node(node, stream, stage)
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def _tag_node(self, node: Node, stream: VirtualStream, stage: str | None) -> NodeTag:
        tag = NodeTag(id(self), next(self._ids), stream, stage)
        _metadata(node)[_TAG] = tag
        self._handles.append(node.register_prehook(functools.partial(self._pre, node, tag)))
        self._handles.append(node.register_hook(functools.partial(self._post, node, tag)))
        return tag

    # --- backward -------------------------------------------------------------------

    def _pre(self, node: Node, tag: NodeTag, grad_outputs: Sequence[torch.Tensor | None]) -> None:
        self.flush()
        tracker = self._host.tracker
        frame = self._stack[-1] if self._stack else None
        if frame is None or frame.running:
            # No backward in flight, or a node is running one of its own (reentrant
            # checkpoint): a new graph task begins.
            frame = self._begin()
        self._apply_waits(tag)
        if tag.id not in self._fed and tag.stream != frame.caller:
            tracker.wait(tag.stream, frame.start)  # a root: its gradient comes from the caller
        self._fed.discard(tag.id)
        if not node.next_functions:
            frame.leaf_streams.add(tag.stream)
        frame.running += 1
        self._window = {}
        self._host.switch_stream(tag.stream)
        self._stage = tag.stage

    def _post(
        self,
        node: Node,
        tag: NodeTag,
        grad_inputs: Sequence[torch.Tensor | None],
        grad_outputs: Sequence[torch.Tensor | None],
    ) -> None:
        if self._stack:
            self._stack[-1].running -= 1
        tracker = self._host.tracker
        window: dict[int, NodeTag] = {}
        for grad, (consumer_node, _) in zip(grad_inputs, node.next_functions, strict=True):
            if grad is None or consumer_node is None:
                continue
            consumer = self._tag(consumer_node) or self._tag_node(
                consumer_node, tag.stream, tag.stage
            )
            self._fed.add(consumer.id)
            key = storage_key(grad)
            if consumer.stream != tag.stream:
                # 1. The consumer's stream waits on an event recorded on ours now.
                # 2. record_stream(consumer) keeps the gradient's block from our reuse.
                self._waits[consumer.id].append(tracker.snapshot(tag.stream))
                if key is not None:
                    tracker.record_stream(key, consumer.stream)
            if key is not None:
                window[key] = consumer
        self._window = window

    def _apply_waits(self, tag: NodeTag) -> None:
        for snapshot in self._waits.pop(tag.id, ()):
            self._host.tracker.wait(tag.stream, snapshot)

    def _begin(self) -> _Backward:
        caller = self._host.stream_now()
        frame = _Backward(caller, self._host.tracker.snapshot(caller), self._stage)
        self._stack.append(frame)
        # The engine's own end-of-backward hook (what DDP and FSDP use): runs when this
        # graph task finishes, where the engine syncs the caller with the leaf streams.
        engine: Any = torch.autograd.Variable._execution_engine
        engine.queue_callback(functools.partial(self._end, frame))
        return frame

    def _end(self, frame: _Backward) -> None:
        tracker = self._host.tracker
        for leaf in frame.leaf_streams:
            if leaf != frame.caller:
                tracker.wait(frame.caller, tracker.snapshot(leaf))
        if self._stack and self._stack[-1] is frame:
            self._stack.pop()
        self._window = {}
        self._host.switch_stream(frame.caller)
        self._stage = frame.stage_before


def _metadata(node: Node) -> dict[str, Any]:
    """The node's metadata dict (a property at runtime; torch's stubs declare a method)."""
    metadata: dict[str, Any] = cast(Any, node).metadata
    return metadata
