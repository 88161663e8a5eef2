"""Which virtual stream (and stage) each autograd node was made on: the engine model's
tags (rules 1, 2 and 8 of ``_engine.py``).

Every node a forward op creates is tagged, in ``node.metadata``, with the stream of that op;
so is every untagged node reached from it (a leaf's ``AccumulateGrad`` takes the stream of
the first op that used the leaf). A node the detector saw no tensor of (functorch's wrapper
nodes) is matched to the op that made it by its autograd sequence number.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.graph import Node

from .._compat import autograd_sequence_nr, node_metadata, node_sequence_nr
from ._simulated import VirtualStream

__all__ = ["NodeTag", "NodeTags"]

_TAG = "ooo_wrap.testing.stream"


@dataclass(frozen=True)
class NodeTag:
    """The virtual stream (and stage) an autograd node was created on."""

    owner: int
    id: int
    stream: VirtualStream
    stage: str | None


class NodeTags:
    """Tags nodes as forward creates them; ``on_tag(node, tag)`` runs for each node tagged
    (where the engine model hooks it)."""

    def __init__(self, on_tag: Callable[[Node, NodeTag], None]) -> None:
        self._on_tag = on_tag
        self._ids = itertools.count()
        self._pending: tuple[list[torch.Tensor], VirtualStream, str | None] | None = None
        # Per thread, the autograd sequence number after each op, and the op's stream
        # and stage (rule 8); nodes numbered before detection began are not matched.
        self._seqs: defaultdict[int, list[int]] = defaultdict(list)
        self._makers: defaultdict[int, list[tuple[VirtualStream, str | None]]] = defaultdict(list)
        self._seq_start = {threading.get_ident(): autograd_sequence_nr()}

    def created(
        self, outputs: list[torch.Tensor], stream: VirtualStream, stage: str | None
    ) -> None:
        """An op made ``outputs`` on ``stream``; autograd sets their ``grad_fn`` after it
        returns, so they are tagged at the next op (kept alive until then)."""
        self.flush()
        thread = threading.get_ident()
        self._seqs[thread].append(autograd_sequence_nr())
        self._makers[thread].append((stream, stage))
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
            if node is not None and self.get(node) is None:
                self._tag_graph(node, stream, stage)

    def get(self, node: Node) -> NodeTag | None:
        """The tag ``node`` was given here, if any."""
        tag = node_metadata(node).get(_TAG)
        return tag if isinstance(tag, NodeTag) and tag.owner == id(self) else None

    def unseen(self, node: Node) -> NodeTag | None:
        """Tag a node the detector saw no tensor of, with the op that made it (rule 8).

        That op is the first one after the node's number was drawn. ``AccumulateGrad``
        nodes have no number (the largest one), so they are never matched here.
        """
        thread = threading.get_ident()
        seqs = self._seqs.get(thread)
        number = node_sequence_nr(node)
        if not seqs or number < self._seq_start.get(thread, 0):
            return None
        i = bisect.bisect_right(seqs, number)
        if i == len(seqs):
            return None
        stream, stage = self._makers[thread][i]
        return self.tag(node, stream, stage)

    def tag(self, node: Node, stream: VirtualStream, stage: str | None) -> NodeTag:
        """Tag ``node`` as made on ``stream`` (in ``stage``)."""
        tag = NodeTag(id(self), next(self._ids), stream, stage)
        node_metadata(node)[_TAG] = tag
        self._on_tag(node, tag)
        return tag

    def next_id(self) -> int:
        """An id below every tag made from now on (tags are numbered in order)."""
        return next(self._ids)

    def close(self) -> None:
        """Release the pending outputs and forget the sequence numbers."""
        self._pending = None
        self._seqs.clear()
        self._makers.clear()

    def _tag_graph(self, root: Node, stream: VirtualStream, stage: str | None) -> None:
        stack = [root]
        while stack:
            node = stack.pop()
            if self.get(node) is not None:
                continue
            self.tag(node, stream, stage)
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
