"""A model of the autograd engine's stream semantics, driven by node hooks on the CPU.

What the real engine does (``torch/csrc/autograd/engine.cpp``, ``input_buffer.cpp``), and
how each point is modelled here:

1. A node runs on the stream that was current when it was created in forward: every new
   node is tagged (``node.metadata``) with the virtual stream of the op that created it,
   and its pre-hook makes that stream current while it runs.
2. An ``AccumulateGrad`` node takes the stream current when the leaf's grad accumulator
   was created, i.e. the first op that used the leaf in this graph: an untagged node
   reached from a new node is tagged with that node's stream. If the accumulator outlives
   a step (something holds the old graph), it keeps its old tag, as the engine's does;
   a gradient handed to it from a node on another stream is recorded as a mismatch
   (what torch >= 2.9 warns of). The model's own hooks hold no node, so they keep no
   dropped graph alive.
3. A gradient passing from a producer to a consumer node on another stream: the consumer
   (or the accumulation into its input buffer) waits on an event recorded on the producer
   when the producer finished, and the engine calls ``record_stream(consumer)`` on the
   gradient. Accumulation of several gradients runs on the consumer's stream. One
   gradient tensor may feed several consumers (``a + b`` hands its gradient to both), so
   accumulations are matched to the edges that fed an input twice, in edge order, never
   by storage alone.
4. The graph root waits on the stream that called ``backward()``, and the engine
   ``record_stream``s the root gradients (made on the caller's stream) to the root's.
   With several roots the engine's ``GraphRoot`` node (no hook sees it) puts each root
   gradient in its root's input buffer first, produced on the caller's stream; a root
   that another root's backward also feeds (``backward([ya, b(ya)])``) sums the two on
   its own stream after waiting on the caller's and on that producer's (rule 3). Such a
   sum is recognized by the op: a gradient just fed to an empty slot, added to another
   tensor.
5. Tensor hooks (``y.register_hook``) run inside the consuming node's call, on its stream
   after its waits, but before its node pre-hooks: the engine's running node starts at
   the first op it runs, whichever hook comes first.
6. At the end of ``backward()`` the caller's stream waits on every leaf stream (streams
   of nodes with no outputs, such as ``AccumulateGrad``), so the caller may read ``.grad``.
   ``torch.autograd.grad`` runs no ``AccumulateGrad``: the engine captures the gradient
   at that node instead and counts its stream as a leaf stream too, which is modelled by
   counting the stream of every ``AccumulateGrad`` fed a gradient but never run (one
   skipped as not needed, e.g. for a parameter left out of ``inputs=``, counts too: more
   order than the engine gives, only there).
   A leaf whose ``.grad`` is already set has the new gradient added into it in place
   (``AccumulateGrad::accumulateGrad`` with grad mode off) on the accumulator's stream,
   with no ``record_stream``. That is no allocator hazard when ``.grad`` was allocated on
   the caller's stream: the leaf holds it until the caller drops it, after ``backward()``
   returned, and the caller's stream has waited on the accumulator's by then, so no reuse
   from its pool can overtake the write. It is modelled as a ``record_stream`` for the
   accumulator's stream (races are still checked).
7. A backward run from inside a node (reentrant checkpoint) is a graph task of its own:
   it ends when that node finishes, whatever order the engine runs its final callbacks in.
8. Under ``torch.func.grad`` the nodes belong to functorch's wrapper tensors, which the
   dispatch mode never sees (it sees the tensors they wrap, which have no ``grad_fn``),
   yet the engine runs them as any other. A node is matched to the op that made it by
   its sequence number (autograd numbers nodes per thread as it makes them, before the
   op reaches the dispatch mode): it is tagged when it first runs an op, and the nodes
   it feeds when it ends, from there on as in rules 1 to 6.

The producer/consumer rules (3) are those of ``engine.cpp`` and ``input_buffer.cpp`` since
torch 2.9 (the rewrite of the producer-consumer stream syncs: ready events, accumulation on
the consumer's stream); :data:`CHECKED_TORCH` is the range the model was checked against.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from .._compat import current_autograd_node, queue_engine_callback
from .._planner.intercept import OpOverload
from ._node_tags import NodeTag, NodeTags
from ._ops import storage_key
from ._simulated import VirtualStream
from ._tracker import Clock, StreamTracker

__all__ = ["CHECKED_TORCH", "AccumulatorMismatch", "EngineHost", "EngineModel"]

# The torch releases (major, minor) the model was checked against: it follows the
# producer/consumer stream syncs of engine.cpp and input_buffer.cpp as rewritten for 2.9,
# and this test suite passes on 2.13. check() adds a note to its report outside them.
CHECKED_TORCH = ((2, 9), (2, 13))

_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
# The ops the engine sums two gradients for one input with (``InputBuffer::accumulate``).
_SUMS = frozenset({torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor})


class EngineHost(Protocol):
    """What the engine model needs from the detection that owns it.

    Its one implementation is ``_detection.Detection``, which imports this module: a protocol
    here, rather than that class, keeps the import one-way (and says how little is used).
    """

    tracker: StreamTracker

    def stream_now(self) -> VirtualStream:
        """The calling thread's current virtual stream (without logging a backend call)."""
        ...

    def switch_stream(self, stream: VirtualStream) -> None:
        """Make ``stream`` current, as the engine's stream guard does (not logged)."""
        ...


@dataclass(frozen=True)
class AccumulatorMismatch:
    """A gradient accumulated on another stream than the node that produced it ran on."""

    stage: str | None  # the producer's stage
    producer: VirtualStream
    accumulator: VirtualStream
    stale: bool  # the accumulator was made before the last backward ended


_Edges = tuple[tuple[Node | None, int], ...]


@dataclass
class _Backward:
    """One ``backward()`` (or ``autograd.grad``) call in flight."""

    caller: VirtualStream
    start: Clock
    stage_before: str | None
    leaf_streams: set[VirtualStream] = field(default_factory=set)
    # AccumulateGrad nodes fed a gradient and not run (yet): tag id -> stream.
    unrun: dict[int, VirtualStream] = field(default_factory=dict)
    running: int = 0
    nested: bool = False
    done: bool = False


class EngineModel:
    """Tags nodes as forward creates them and replays the engine's syncs in backward."""

    def __init__(self, host: EngineHost) -> None:
        self._host = host
        self._tags = NodeTags(self._hook)
        self._waits: defaultdict[int, list[Clock]] = defaultdict(list)
        self._fed: set[int] = set()
        self._buffered: defaultdict[int, set[int]] = defaultdict(set)
        self._stack: list[_Backward] = []
        self._running: set[int] = set()
        self._finished: int | None = None
        self._window: list[tuple[int | None, NodeTag]] = []
        # The last finished node's gradients that went to an empty input slot: the slot
        # may already hold a root gradient from the caller, which no hook saw arrive.
        self._first: list[tuple[int, NodeTag]] = []
        self._handles: list[RemovableHandle] = []
        self._stage: str | None = None
        self.mismatches: list[AccumulatorMismatch] = []
        self._fresh_from = 0  # tags from this id on were made after the last backward
        # This backward's accumulators fed from another stream, and those fed from theirs.
        self._away: dict[int, AccumulatorMismatch] = {}
        self._fed_in_place: set[int] = set()

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
        """An op made ``outputs`` on ``stream`` (see :meth:`NodeTags.created`)."""
        self._tags.created(outputs, stream, stage)

    def flush(self) -> None:
        """Tag the nodes of the last op's outputs, and release them."""
        self._tags.flush()

    def accumulation_target(self, func: OpOverload, keys: Iterable[int]) -> NodeTag | None:
        """The consumer node whose input buffer an op between two nodes accumulates into.

        The engine adds a second gradient for one input on the consumer's stream, after
        waiting on every producer so far: the waits are applied here, and the op is to
        be attributed to the returned node's stream. Accumulations come in the order of
        the producer's edges; the op must read that edge's gradient.
        """
        read = set(keys)
        if self._window:
            key, consumer = self._window[0]
            if key is None or key in read:
                del self._window[0]
                self._apply_waits(consumer)
                return consumer
        return self._root_sum(func, read)

    def _root_sum(self, func: OpOverload, read: set[int]) -> NodeTag | None:
        """The root whose caller-given gradient this op sums with one just fed to it."""
        if func not in _SUMS or len(read) < 2 or not self._stack:
            return None
        found = next((i for i, (key, _) in enumerate(self._first) if key in read), None)
        if found is None:
            return None
        consumer = self._first[found][1]
        del self._first[: found + 1]
        self._apply_waits(consumer)
        frame = self._stack[-1]
        if consumer.stream != frame.caller:
            # The root gradient's ready event, recorded on the caller's stream; the
            # engine record_streams both addends to the stream that sums them.
            tracker = self._host.tracker
            tracker.wait(consumer.stream, frame.start)
            for other in read:
                tracker.record_stream(other, consumer.stream)
        return consumer

    def catch_up(self) -> None:
        """Start the node the engine runs now if its pre-hook was missed.

        Two cases: tensor hooks (``y.register_hook``) run inside the consuming node's call,
        on its stream after its waits, but before its node pre-hooks; and a backward run
        from inside a node (reentrant checkpoint) may start at a node whose hooks did not
        exist yet when the engine called it (the last op of the recomputation made it, and
        no op ran since to tag it). Ops of a node that has finished (its gradients being
        summed into the next input buffers) start nothing.
        """
        node = current_autograd_node()
        if node is None:
            return
        tag = self._tags.get(node)
        if tag is None:
            self.flush()
            tag = self._tags.get(node) or self._tags.unseen(node)
        if tag is not None and tag.id not in self._running and tag.id != self._finished:
            self._pre(tuple(node.next_functions), tag, ())

    def close(self) -> None:
        """Remove every hook this model installed and forget its state."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._tags.close()
        self._waits.clear()
        self._window.clear()
        self._first.clear()
        self._buffered.clear()
        self._running.clear()
        self._stack.clear()
        self._away.clear()
        self._fed_in_place.clear()

    def stream_of(self, node: Node) -> VirtualStream | None:
        """The stream ``node`` was tagged with, if this model tagged it."""
        tag = self._tags.get(node)
        return None if tag is None else tag.stream

    def _hook(self, node: Node, tag: NodeTag) -> None:
        # The hooks hold the node's edges, never the node: the node holds its hooks, and a
        # hook holding it would be a cycle that keeps a dropped graph (and the parameters'
        # accumulators in it) alive until a garbage collection, so the next step would
        # reuse old nodes where a real loop that drops its graph makes fresh ones.
        edges: _Edges = tuple(node.next_functions)
        self._handles.append(node.register_prehook(functools.partial(self._pre, edges, tag)))
        self._handles.append(node.register_hook(functools.partial(self._post, edges, tag)))
        leaf = getattr(node, "variable", None) if node.name() == _ACCUMULATE_GRAD else None
        if isinstance(leaf, torch.Tensor):
            # A weak reference: the node holds its leaf, and its hooks must not.
            into = functools.partial(self._into_grad, weakref.ref(leaf), tag)
            self._handles.append(node.register_prehook(into))

    # --- backward -------------------------------------------------------------------

    def _pre(
        self, edges: _Edges, tag: NodeTag, grad_outputs: Sequence[torch.Tensor | None]
    ) -> None:
        if tag.id in self._running:
            return  # started early by catch_up
        self.flush()
        tracker = self._host.tracker
        frame = self._stack[-1] if self._stack else None
        if frame is None or frame.running:
            # No backward in flight, or a node is running one of its own (reentrant
            # checkpoint): a new graph task begins.
            frame = self._begin(nested=frame is not None)
        self._apply_waits(tag)
        if tag.id not in self._fed and tag.stream != frame.caller:
            # A root: its gradient comes from the caller, which the root's stream waits
            # on; the engine record_streams that gradient to the root's stream.
            tracker.wait(tag.stream, frame.start)
            for grad in grad_outputs:
                key = None if grad is None else storage_key(grad)
                if key is not None:
                    tracker.record_stream(key, tag.stream)
        self._fed.discard(tag.id)
        self._buffered.pop(tag.id, None)
        self._running.add(tag.id)
        frame.unrun.pop(tag.id, None)
        if not edges:
            frame.leaf_streams.add(tag.stream)
        frame.running += 1
        self._window, self._first = [], []
        self._host.switch_stream(tag.stream)
        self._stage = tag.stage

    def _post(
        self,
        edges: _Edges,
        tag: NodeTag,
        grad_inputs: Sequence[torch.Tensor | None],
        grad_outputs: Sequence[torch.Tensor | None],
    ) -> None:
        if tag.id not in self._running:
            self._pre(edges, tag, ())  # hooked while it ran (see catch_up)
        self._running.discard(tag.id)
        self._finished = tag.id
        if self._stack and self._stack[-1].running == 0 and self._stack[-1].nested:
            # A backward run from inside this node (reentrant checkpoint) is over.
            self._end(self._stack[-1])
        if self._stack:
            self._stack[-1].running -= 1
        tracker = self._host.tracker
        window: list[tuple[int | None, NodeTag]] = []
        first: list[tuple[int, NodeTag]] = []
        for grad, (consumer_node, slot) in zip(grad_inputs, edges, strict=True):
            if grad is None or consumer_node is None:
                continue
            consumer = (
                self._tags.get(consumer_node)
                or self._tags.unseen(consumer_node)
                or self._tags.tag(consumer_node, tag.stream, tag.stage)
            )
            self._fed.add(consumer.id)
            if consumer_node.name() == _ACCUMULATE_GRAD:
                if self._stack:
                    self._stack[-1].unrun[consumer.id] = consumer.stream
                if consumer.stream == tag.stream:
                    self._fed_in_place.add(consumer.id)
                else:
                    # The engine warns of this (torch >= 2.9). Kept, when the backward
                    # ends, only if no gradient came from the accumulator's own stream
                    # (else a parameter two streams' stages share): it was made on
                    # another stream, typically by an older graph that still holds it.
                    stale = consumer.id < self._fresh_from
                    self._away.setdefault(
                        consumer.id,
                        AccumulatorMismatch(tag.stage, tag.stream, consumer.stream, stale),
                    )
            key = storage_key(grad)
            if consumer.stream != tag.stream:
                # 1. The consumer's stream waits on an event recorded on ours now.
                # 2. record_stream(consumer) keeps the gradient's block from our reuse.
                self._waits[consumer.id].append(tracker.snapshot(tag.stream))
                if key is not None:
                    tracker.record_stream(key, consumer.stream)
            slots = self._buffered[consumer.id]
            if slot in slots:
                window.append((key, consumer))  # a second gradient for this input: a sum
            elif key is not None:
                first.append((key, consumer))
            slots.add(slot)
        self._window, self._first = window, first

    def _into_grad(
        self,
        leaf: weakref.ref[torch.Tensor],
        tag: NodeTag,
        grad_outputs: Sequence[torch.Tensor | None],
    ) -> None:
        """An accumulator about to add into its leaf's ``.grad`` in place (rule 6)."""
        tensor = leaf()
        grad = None if tensor is None else tensor.grad
        if grad is None or grad.layout != torch.strided or torch.is_grad_enabled():
            return  # no .grad yet (it takes the gradient), or replaced out of place
        key = storage_key(grad)
        tracker = self._host.tracker
        if key is not None and self._stack and tracker.allocated_on(key) == self._stack[-1].caller:
            tracker.record_stream(key, tag.stream)

    def _apply_waits(self, tag: NodeTag) -> None:
        for snapshot in self._waits.pop(tag.id, ()):
            self._host.tracker.wait(tag.stream, snapshot)

    def _begin(self, nested: bool) -> _Backward:
        caller = self._host.stream_now()
        frame = _Backward(caller, self._host.tracker.snapshot(caller), self._stage, nested=nested)
        self._stack.append(frame)
        # Runs when this graph task finishes, where the engine syncs the caller with the
        # leaf streams.
        queue_engine_callback(functools.partial(self._end, frame))
        return frame

    def _end(self, frame: _Backward) -> None:
        # Runs once per graph task: at the end of a nested backward (from _post), and as
        # the engine's final callback, which for a nested task may come only at the end
        # of the outer backward, after the outer frame's own.
        if frame.done:
            return
        frame.done = True
        tracker = self._host.tracker
        for leaf in frame.leaf_streams | set(frame.unrun.values()):
            if leaf != frame.caller:
                tracker.wait(frame.caller, tracker.snapshot(leaf))
        while self._stack:
            if self._stack.pop() is frame:
                break
        if not self._stack:
            self._buffered.clear()
            self._finished = None
            self._fresh_from = self._tags.next_id()
            self.mismatches += [m for key, m in self._away.items() if key not in self._fed_in_place]
            self._away.clear()
            self._fed_in_place.clear()
        self._window, self._first = [], []
        self._host.switch_stream(frame.caller)
        self._stage = frame.stage_before
