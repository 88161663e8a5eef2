"""Stream assignment by dependency: chains share a stream, independent branches do not.

Two assigners, both pure functions of an observed :class:`~ooo_wrap._planner.observe.CallRecord`:

* :func:`assign_regions` walks the call tree from the root. Every call is decomposed into
  chains and branches (``regions``); a group of branches that
  :meth:`~ooo_wrap._planner.regions.RegionRule.choose` accepts is a region. Its heaviest
  branch stays on the caller's stream (unless the region is in ``moved``), the others get
  distinct side streams while there are free ones, and when there are more branches than
  streams, each next-heaviest branch goes to the least-loaded stream (greedy LPT). Stages
  are the child calls of a branch on a side stream, as
  :meth:`~ooo_wrap._planner.regions.RegionRule.side_stages` decides: every link of a
  branch's chain gets that branch's stream, a link that a fork/join would outlast runs
  inline (unless the region is in ``linked``: the planner simulated the step with such
  links as stages and it was faster, their inline ops holding up the caller's stream
  in the backward), and a call with a region inside is split into its links (stages cannot
  nest) only if each of them is worth a stage, else it is one stage.
  Concurrent branches run at once, so the regions inside them get disjoint streams: the
  side streams no branch of the region runs on are shared out among the branches (those
  on one stream run one after the other and share theirs), each as many as its inner
  regions use at once, the next one to the heaviest work per stream when there are too
  few. A branch left with none places its inner regions by least estimated load, the
  concurrent branches' work counted, so they share a stream only where that is lighter
  than staying on the branch's own.
  Outside regions nothing is a stage.
* :func:`assign_named` keeps stages the user named and only picks their streams: in program
  order each stage call continues the stream of its first producer stage whose stream no
  other consumer continued yet (so a chain stays on one stream), else takes a stream no
  concurrent stage call uses, least loaded first.

Streams are side-stream indices ``0..streams-1``; ``None`` is the caller's stream.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from .cost import ReferenceGPU
from .observe import CallRecord
from .regions import Parallel, RegionChoice, RegionKey, RegionRule, Series, region_key

__all__ = [
    "BranchPlacement",
    "RegionPlacement",
    "RegionWalk",
    "assign_named",
    "assign_regions",
    "named_chain",
    "stage_edges",
]

Lane = tuple[int, int, int]  # (call_id of the region's call, region number, branch number)


class _Branch(NamedTuple):
    """Where a branch's calls are placed while walking (the root call is one on its own).

    ``home``: its stream; ``own``: the side streams its regions may take, no concurrent
    branch using them; ``busy``: estimated µs of concurrent work on the other streams (for
    when ``own`` runs out); ``lane``: the innermost region branch it is, if any;
    ``linked``: its calls cheaper than a fork/join run as stages on ``home`` too.
    """

    home: int | None
    own: tuple[int, ...]
    busy: Mapping[int, float]
    lane: Lane | None
    linked: bool = False


@dataclass(frozen=True)
class BranchPlacement:
    """One branch of a region: its child calls (module names), their estimated µs, its stream.

    ``why``: why it stays on the stream of the region's caller, for the learned table;
    ``launch_us`` and ``occupancy``: its forward kernels' estimated launch time and
    device-time-weighted share of the GPU, for the reason a simulation gives.
    """

    calls: tuple[str, ...]
    call_us: tuple[float, ...]
    stream: int | None
    why: str = ""
    launch_us: float = 0.0
    occupancy: float = 0.0
    call_ids: tuple[int, ...] = ()  # the ``call_id`` of each call in ``calls``

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
    key: RegionKey = ()  # :func:`~ooo_wrap._planner.regions.region_key` of its branches

    @property
    def name(self) -> str:
        base = self.call or "<root>"
        return base if self.section == 0 else f"{base}#{self.section}"


@dataclass
class RegionWalk:
    """The result of :func:`assign_regions`, filled in while walking (see the module doc)."""

    streams: int
    gpu: ReferenceGPU
    vetoed: frozenset[RegionKey] = frozenset()
    moved: frozenset[RegionKey] = frozenset()
    linked: frozenset[RegionKey] = frozenset()
    stage_stream: dict[int, int] = field(default_factory=dict)  # stage call_id -> stream
    lanes: dict[int, Lane | None] = field(default_factory=dict)  # call_id -> innermost branch
    regions: list[RegionPlacement] = field(default_factory=list)
    forward_us: float = 0.0  # estimated critical path of the forward under this plan
    rule: RegionRule = field(init=False)
    _wants: dict[tuple[int, bool], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rule = RegionRule(self.gpu, self.vetoed, self.moved)

    def call(self, call: CallRecord, at: _Branch) -> float:
        """Place ``call``'s insides with ``at.home`` as its stream; return its estimated time."""
        self.lanes[call.call_id] = at.lane
        if not self.rule.has_region(call):
            return call.device_us
        series = self.rule.series(call)
        own_us = self.rule.dag(call).own_us
        return own_us + self._series(call, series, at, [0])

    def _series(self, call: CallRecord, series: Series, at: _Branch, counter: list[int]) -> float:
        total = 0.0
        for part in series.parts:
            if isinstance(part, Parallel):
                total += self._parallel(call, part, at, counter)
            elif at.home is None or self.rule.splits(part):
                total += self.call(part, at)
            else:  # a link on its branch's stream: one stage, or inline if a fork outlasts it
                if self.rule.side_stages(part) or (at.linked and part.device_us > 0):
                    self.stage_stream[part.call_id] = at.home
                self.lanes[part.call_id] = at.lane
                total += part.device_us
        return total

    def _parallel(
        self, call: CallRecord, parallel: Parallel, at: _Branch, counter: list[int]
    ) -> float:
        home, own, busy = at.home, at.own, at.busy
        choice = self.rule.choose(parallel)
        branches = parallel.branches
        if choice is None:  # not worth splitting: one chain on ``home``
            return sum(self._series(call, b, at, counter) for b in branches)
        number, counter[0] = counter[0], counter[0] + 1
        # Streams of its own while there are any; else every stream is taken by concurrent
        # work: the least loaded by estimated cost, if lighter than staying on ``home``.
        pool = list(own) or [s for s in range(self.streams) if s != home]
        load: dict[int | None, float] = {s: 0.0 if own else busy.get(s, 0.0) for s in pool}
        place: list[int | None] = [home] * len(branches)
        load[home] = sum(b.device_us for i, b in enumerate(branches) if i not in choice.leaving)
        for index in choice.leaving:  # heaviest first; ties go to the earliest side stream
            target = min([*pool, home], key=lambda s: load[s])
            place[index] = target
            load[target] += branches[index].device_us
        if all(s == home for s in place):  # no stream worth leaving for
            counter[0] -= 1
            return sum(self._series(call, b, at, counter) for b in branches)
        self.regions.append(
            RegionPlacement(
                call=call.name,
                section=number,
                width=self.rule.dag(call).width(),
                branches=tuple(
                    self._branch(b, place[i], self._why(choice, i, b, place[i] == home))
                    for i, b in enumerate(branches)
                ),
                key=region_key(parallel),
            )
        )
        shares = self._share(branches, place, own)
        times: dict[int | None, float] = {}
        for index, branch in enumerate(branches):
            target = place[index]
            inner_busy = dict(busy)
            for other, (cost, streams) in shares.items():
                if other == target:
                    continue
                for stream in (other, *streams):  # its work spread over its streams
                    if stream is not None:
                        inner_busy[stream] = inner_busy.get(stream, 0.0) + cost / (len(streams) + 1)
            lane = (call.call_id, number, index)
            linked = target != home and region_key(parallel) in self.linked
            inner = _Branch(target, shares[target][1], inner_busy, lane, linked)
            spent = self._series(call, branch, inner, counter)
            times[target] = times.get(target, 0.0) + spent
        return max(times.values())

    def _why(self, choice: RegionChoice, index: int, branch: Series, stays: bool) -> str:
        """Why branch ``index`` stays on the caller's stream ("" if it leaves)."""
        if not stays:
            return ""
        if index not in choice.leaving and index == choice.heaviest:
            return "heaviest branch kept"
        if index in choice.leaving:
            return "no side stream free (the caller's was the least loaded)"
        stages = [stage for call in branch.calls() for stage in self.rule.side_stages(call)]
        return (
            f"below its fork/join cost ({sum(s.device_us for s in stages):.1f} µs of stages, "
            f"{len(stages) * self.gpu.fork_join_us:.1f} µs of fork/joins)"
        )

    def _branch(self, branch: Series, stream: int | None, why: str) -> BranchPlacement:
        ops = [op for call in branch.calls() for op in call.ops() if op.device_us > 0]
        device = sum(op.device_us for op in ops)
        return BranchPlacement(
            tuple(c.name for c in branch.calls()),
            tuple(c.device_us for c in branch.calls()),
            stream,
            why,
            len(ops) * self.gpu.launch_us,
            sum(op.device_us * op.occupancy for op in ops) / device if device else 0.0,
            tuple(c.call_id for c in branch.calls()),
        )

    def _share(
        self, branches: tuple[Series, ...], place: list[int | None], own: tuple[int, ...]
    ) -> dict[int | None, tuple[float, tuple[int, ...]]]:
        """Split the streams of ``own`` no branch runs on among the branches' streams.

        Branches on one stream run one after the other there, so they share what it gets;
        branches on different streams run at once, so their inner regions get disjoint
        streams, each as many as its regions use at once. When there are fewer than asked
        for, each next stream goes to the heaviest work per stream it would have. Returns,
        per stream of a branch, the estimated µs of its branches and the streams it got.
        """
        groups: dict[int | None, list[int]] = {}
        for index, target in enumerate(place):
            groups.setdefault(target, []).append(index)
        cost = {t: sum(branches[i].device_us for i in group) for t, group in groups.items()}
        want = {
            t: max(self._want(branches[i], t is not None) for i in group)
            for t, group in groups.items()
        }
        given: dict[int | None, list[int]] = {t: [] for t in groups}
        for stream in (s for s in own if s not in groups):
            hungry = [t for t in groups if len(given[t]) < want[t]]
            if not hungry:
                break
            neediest = max(hungry, key=lambda t: cost[t] / (len(given[t]) + 1))
            given[neediest].append(stream)
        return {t: (cost[t], tuple(given[t])) for t in groups}

    def _want(self, series: Series, side: bool) -> int:
        """The most side streams the regions inside ``series`` use at once, besides the
        stream ``series`` runs on (``side``: a side stream, where calls split or not)."""
        most = 0
        for part in series.parts:
            if isinstance(part, Parallel):
                choice = self.rule.choose(part)
                if choice is None:
                    wanted = max(self._want(b, side) for b in part.branches)
                else:  # the leaving branches run at once with the staying ones
                    staying = [b for i, b in enumerate(part.branches) if i not in choice.leaving]
                    wanted = max((self._want(b, side) for b in staying), default=0) + sum(
                        1 + self._want(part.branches[i], True) for i in choice.leaving
                    )
            else:
                key = (part.call_id, side)
                if key not in self._wants:
                    inside = self.rule.splits(part) if side else self.rule.has_region(part)
                    self._wants[key] = self._want(self.rule.series(part), side) if inside else 0
                wanted = self._wants[key]
            most = max(most, wanted)
        return most


def assign_regions(
    root: CallRecord,
    streams: int,
    gpu: ReferenceGPU,
    vetoed: frozenset[RegionKey] = frozenset(),
    moved: frozenset[RegionKey] = frozenset(),
    linked: frozenset[RegionKey] = frozenset(),
) -> RegionWalk:
    """Find every region under ``root`` (none of ``vetoed``) and give each stage call a
    side stream; the heaviest branch of a region in ``moved`` leaves the caller's too; in
    the branches that leave it of a region in ``linked``, calls cheaper than a fork/join
    are stages on their branch's stream too (else they run inline on the caller's)."""
    walk = RegionWalk(streams, gpu, vetoed, moved, linked)
    walk.forward_us = walk.call(root, _Branch(None, tuple(range(streams)), {}, None))
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


def named_chain(root: CallRecord, names: Collection[str]) -> tuple[str, ...]:
    """The named stages' calls in program order if they form one chain (each reads, directly
    or through the caller's ops, what the one before it wrote, so no two can run at once),
    else ``()``; also ``()`` for fewer than two calls."""
    calls = _outermost(root, set(names))
    if len(calls) < 2:
        return ()
    preds: dict[int, set[int]] = {call.call_id: set() for call in calls}
    for producer, consumer in stage_edges(root, preds):
        preds[consumer].add(producer)
    # Each call must depend on the one before it: then, by transitivity, on all before it.
    if any(a.call_id not in preds[b.call_id] for a, b in itertools.pairwise(calls)):
        return ()
    return tuple(call.name for call in calls)


def _outermost(call: CallRecord, names: set[str]) -> list[CallRecord]:
    found: list[CallRecord] = []
    for child in call.children:
        found += [child] if child.name in names else _outermost(child, names)
    return found
