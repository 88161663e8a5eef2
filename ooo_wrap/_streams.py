"""Stream assignment by dependency: chains share a stream, independent branches do not.

Two assigners, both pure functions of an observed :class:`~ooo_wrap._observe.CallRecord`:

* :func:`assign_regions` walks the call tree from the root. Every call is decomposed into
  chains and branches (``_regions``); a group of branches that :func:`~ooo_wrap._regions.choose`
  accepts is a region. Its heaviest branch stays on the caller's stream, the others get
  distinct side streams while there are free ones (streams already busy with a concurrent
  branch of an enclosing region are avoided), and when there are more branches than
  streams, each next-heaviest branch goes to the least-loaded stream (greedy LPT). Stages
  are the child calls of a branch on a side stream (those that launch a kernel); every link
  of a branch's chain gets that branch's stream. A branch that contains a region deeper
  down is not one stage (stages cannot nest): its links become stages on its stream and
  the inner region is split again.
  Outside regions nothing is a stage.
* :func:`assign_named` keeps stages the user named and only picks their streams: in program
  order each stage call continues the stream of its first producer stage whose stream no
  other consumer continued yet (so a chain stays on one stream), else takes a stream no
  concurrent stage call uses, least loaded first.

Streams are side-stream indices ``0..streams-1``; ``None`` is the caller's stream.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from ._cost import ReferenceGPU
from ._observe import CallRecord
from ._regions import CallDag, Parallel, Series, call_dag, choose

__all__ = [
    "BranchPlacement",
    "RegionPlacement",
    "RegionWalk",
    "assign_named",
    "assign_regions",
    "stage_edges",
]

Lane = tuple[int, int, int]  # (call_id of the region's call, region number, branch number)


@dataclass(frozen=True)
class BranchPlacement:
    """One branch of a region: its child calls (module names), their estimated µs, its stream."""

    calls: tuple[str, ...]
    call_us: tuple[float, ...]
    stream: int | None

    @property
    def device_us(self) -> float:
        return sum(self.call_us)


@dataclass(frozen=True)
class RegionPlacement:
    """A parallel region: the call it is in, its DAG width and its branches.

    ``section`` numbers the regions of one call (a forward may fork and join twice).
    """

    call: str
    section: int
    width: int
    branches: tuple[BranchPlacement, ...]

    @property
    def name(self) -> str:
        base = self.call or "<root>"
        return base if self.section == 0 else f"{base}#{self.section}"


@dataclass
class RegionWalk:
    """The result of :func:`assign_regions`, filled in while walking (see the module doc)."""

    streams: int
    gpu: ReferenceGPU
    stage_stream: dict[int, int] = field(default_factory=dict)  # stage call_id -> stream
    lanes: dict[int, Lane | None] = field(default_factory=dict)  # call_id -> innermost branch
    regions: list[RegionPlacement] = field(default_factory=list)
    forward_us: float = 0.0  # estimated critical path of the forward under this plan
    _dags: dict[int, CallDag] = field(default_factory=dict)
    _deep: dict[int, bool] = field(default_factory=dict)

    def dag(self, call: CallRecord) -> CallDag:
        """The (cached) child DAG of ``call``."""
        if call.call_id not in self._dags:
            self._dags[call.call_id] = call_dag(call)
        return self._dags[call.call_id]

    def has_region(self, call: CallRecord) -> bool:
        """Whether a region exists anywhere inside ``call`` (streams aside)."""
        if call.call_id not in self._deep:
            parts = list(self._parallels(self.dag(call).series()))
            self._deep[call.call_id] = any(choose(p, self.gpu) for p in parts) or any(
                self.has_region(child) for child in call.children
            )
        return self._deep[call.call_id]

    def _parallels(self, series: Series) -> list[Parallel]:
        found: list[Parallel] = []
        for part in series.parts:
            if isinstance(part, Parallel):
                found.append(part)
                for branch in part.branches:
                    found += self._parallels(branch)
        return found

    def call(
        self, call: CallRecord, home: int | None, avoid: frozenset[int], lane: Lane | None
    ) -> float:
        """Place ``call``'s insides with ``home`` as its stream; return its estimated time."""
        self.lanes[call.call_id] = lane
        if not self.has_region(call):
            return call.device_us
        dag = self.dag(call)
        return dag.own_us + self._series(call, dag.series(), home, avoid, lane, [0])

    def _series(
        self,
        call: CallRecord,
        series: Series,
        home: int | None,
        avoid: frozenset[int],
        lane: Lane | None,
        counter: list[int],
    ) -> float:
        total = 0.0
        for part in series.parts:
            if isinstance(part, Parallel):
                total += self._parallel(call, part, home, avoid, lane, counter)
            elif home is not None and not self.has_region(part):
                if part.device_us > 0:  # a call that launches no kernel is not worth a fork
                    self.stage_stream[part.call_id] = home  # a link on its branch's stream
                self.lanes[part.call_id] = lane
                total += part.device_us
            else:
                total += self.call(part, home, avoid, lane)
        return total

    def _parallel(
        self,
        call: CallRecord,
        parallel: Parallel,
        home: int | None,
        avoid: frozenset[int],
        lane: Lane | None,
        counter: list[int],
    ) -> float:
        choice = choose(parallel, self.gpu)
        branches = parallel.branches
        if choice is None:  # not worth splitting: one chain on ``home``
            return sum(self._series(call, b, home, avoid, lane, counter) for b in branches)
        number, counter[0] = counter[0], counter[0] + 1
        free = [s for s in range(self.streams) if s != home and s not in avoid]
        pool = free or [s for s in range(self.streams) if s != home]
        place: list[int | None] = [home] * len(branches)
        load: dict[int | None, float] = {s: 0.0 for s in pool}
        load[home] = sum(b.device_us for i, b in enumerate(branches) if i not in choice.leaving)
        for index in choice.leaving:  # heaviest first; ties go to the earliest side stream
            target = min([*pool, home], key=lambda s: load[s])
            place[index] = target
            load[target] += branches[index].device_us
        if all(s == home for s in place):  # no stream to leave for (``streams`` is 1)
            counter[0] -= 1
            return sum(self._series(call, b, home, avoid, lane, counter) for b in branches)
        self.regions.append(
            RegionPlacement(
                call=call.name,
                section=number,
                width=self.dag(call).width(),
                branches=tuple(
                    BranchPlacement(
                        tuple(c.name for c in b.calls()),
                        tuple(c.device_us for c in b.calls()),
                        place[i],
                    )
                    for i, b in enumerate(branches)
                ),
            )
        )
        used = frozenset(s for s in place if s is not None)
        times: dict[int | None, float] = {}
        for index, branch in enumerate(branches):
            target = place[index]
            inner_avoid = avoid | (used - {target} if target is not None else used)
            branch_lane = (call.call_id, number, index)
            spent = self._series(call, branch, target, inner_avoid, branch_lane, counter)
            times[target] = times.get(target, 0.0) + spent
        return max(times.values())


def assign_regions(root: CallRecord, streams: int, gpu: ReferenceGPU) -> RegionWalk:
    """Find every region under ``root`` and give each stage call a side stream."""
    walk = RegionWalk(streams, gpu)
    walk.forward_us = walk.call(root, None, frozenset(), None)
    return walk


def stage_edges(root: CallRecord, stages: Collection[int]) -> list[tuple[int, int]]:
    """Dataflow edges ``(producer, consumer)`` between stage calls (by ``call_id``).

    A consumer stage call reads a storage whose contents came from a producer stage call,
    directly or through ops outside any stage (which run on the caller's stream).
    """
    sources: dict[int, frozenset[int]] = {}  # storage -> stage calls its contents came from
    edges: dict[tuple[int, int], None] = {}

    def visit(call: CallRecord, owner: int | None) -> None:
        for item in call.items:
            if isinstance(item, CallRecord):
                inner = item.call_id if owner is None and item.call_id in stages else owner
                visit(item, inner)
                continue
            found: frozenset[int] = frozenset()
            for key in (*item.reads, *item.writes):
                found |= sources.get(key, frozenset())
            if owner is not None:
                edges.update(((p, owner), None) for p in sorted(found) if p != owner)
                found = frozenset({owner})
            for key in (*item.writes, *item.fresh):
                sources[key] = found

    visit(root, None)
    return list(edges)


def assign_named(root: CallRecord, names: Collection[str], streams: int) -> dict[str, int]:
    """Streams for user-named stages from the observed dataflow (see the module doc)."""
    calls = _outermost(root, set(names))
    by_id = {call.call_id: call for call in calls}
    preds: dict[int, list[int]] = {call.call_id: [] for call in calls}
    for producer, consumer in stage_edges(root, by_id):
        preds[consumer].append(producer)
    ancestors: dict[int, set[int]] = {}
    stream_of_call: dict[int, int] = {}
    chosen: dict[str, int] = {}
    claimed: set[int] = set()
    load = [0.0] * streams
    for call in calls:
        ancestors[call.call_id] = set(preds[call.call_id])
        for p in preds[call.call_id]:
            ancestors[call.call_id] |= ancestors[p]
        stream = chosen.get(call.name)
        if stream is None:
            unclaimed = [p for p in sorted(preds[call.call_id]) if p not in claimed]
            if unclaimed:
                claimed.add(unclaimed[0])
                stream = stream_of_call[unclaimed[0]]
            else:
                busy = {s for c, s in stream_of_call.items() if c not in ancestors[call.call_id]}
                candidates = [s for s in range(streams) if s not in busy] or list(range(streams))
                stream = min(candidates, key=lambda s: load[s])
            chosen[call.name] = stream
        stream_of_call[call.call_id] = stream
        load[stream] += by_id[call.call_id].device_us
    return chosen


def _outermost(call: CallRecord, names: set[str]) -> list[CallRecord]:
    found: list[CallRecord] = []
    for child in call.children:
        found += [child] if child.name in names else _outermost(child, names)
    return found
