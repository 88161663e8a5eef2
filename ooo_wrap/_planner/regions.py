"""Parallel regions of one module call: the DAG of its child calls, split into chains and branches.

For a call, the nodes are its child calls; the parent's own ops between them are not nodes
but carry dependencies (child ``a`` feeds an op of the parent that feeds child ``b``: ``b``
depends on ``a``). A node depends on an earlier one when it reads a storage the earlier one
wrote (or wrote one the earlier one read or wrote: in-place ops order too).

The DAG is then decomposed, series first: a *cut* is a child comparable with every other
(everything before it feeds it, everything after it is fed by it); between two cuts the
children split into *branches*, the connected groups of mutually dependent children. A
branch is decomposed again the same way. What cannot be decomposed (a tangle such as
``a->c, a->d, b->d``) is kept whole as a chain, in program order: chains are never split.

Whether a group of branches is a parallel *region*, and which stages a call on a side
stream runs as, is decided by :class:`RegionRule`; the rule and its numbers are in its
docstrings.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from .cost import ReferenceGPU
from .observe import CallRecord, ObservedOp

__all__ = [
    "CallDag",
    "Parallel",
    "RegionChoice",
    "RegionKey",
    "RegionRule",
    "Series",
    "call_dag",
    "choose",
    "parallels",
    "region_key",
]


@dataclass(frozen=True)
class Parallel:
    """Branches that do not depend on each other (each one a :class:`Series`)."""

    branches: tuple[Series, ...]


@dataclass(frozen=True)
class Series:
    """Parts that run one after the other: child calls, or groups of parallel branches."""

    parts: tuple[CallRecord | Parallel, ...]

    def calls(self) -> Iterator[CallRecord]:
        """Every child call in this series, nested branches included, in order."""
        for part in self.parts:
            if isinstance(part, CallRecord):
                yield part
            else:
                for branch in part.branches:
                    yield from branch.calls()

    @cached_property
    def device_us(self) -> float:
        """Estimated device time of all its calls, run one after the other."""
        return sum(call.device_us for call in self.calls())


@dataclass(frozen=True)
class CallDag:
    """The dependency DAG of one call's children.

    Attributes:
        children: the child calls in program order.
        ancestors: per child, the indices of every child it depends on (transitively).
        own_us: estimated device time of the parent's own ops (they stay on its stream).
    """

    children: tuple[CallRecord, ...]
    ancestors: tuple[frozenset[int], ...]
    own_us: float

    def comparable(self, a: int, b: int) -> bool:
        """Whether one of the two children depends on the other."""
        return a in self.ancestors[b] or b in self.ancestors[a]

    def width(self) -> int:
        """The most children that can run at once (the largest antichain).

        By Dilworth's theorem it is the number of children minus a maximum matching in the
        bipartite "``u`` precedes ``v``" graph (Kuhn's augmenting paths; DAGs here are small).
        """
        n = len(self.children)
        successors = [[v for v in range(n) if u in self.ancestors[v]] for u in range(n)]
        match: list[int | None] = [None] * n  # right side v -> matched left side u

        def augment(u: int, seen: set[int]) -> bool:
            for v in successors[u]:
                if v in seen:
                    continue
                seen.add(v)
                owner = match[v]
                if owner is None or augment(owner, seen):
                    match[v] = u
                    return True
            return False

        matched = sum(augment(u, set()) for u in range(n))
        return n - matched

    def series(self) -> Series:
        """The series-parallel decomposition of the children (see the module docstring)."""
        return self._decompose(list(range(len(self.children))))

    def heaviest_chain(self) -> list[CallRecord]:
        """The chain of children with the largest estimated device time, in order."""
        best: list[tuple[float, int | None]] = []
        for i, child in enumerate(self.children):
            before = max(((best[j][0], j) for j in self.ancestors[i]), default=(0.0, None))
            best.append((before[0] + child.device_us, before[1]))
        if not best:
            return []
        node: int | None = max(range(len(best)), key=lambda i: best[i][0])
        chain: list[CallRecord] = []
        while node is not None:
            chain.append(self.children[node])
            node = best[node][1]
        return chain[::-1]

    def _decompose(self, nodes: list[int]) -> Series:
        if len(nodes) == 1:
            return Series((self.children[nodes[0]],))
        cuts = {a for a in nodes if all(self.comparable(a, b) for b in nodes if b != a)}
        parts: list[CallRecord | Parallel] = []
        segment: list[int] = []
        for node in [*nodes, None]:
            if node is not None and node not in cuts:
                segment.append(node)
                continue
            if segment:
                groups = self._components(segment)
                if len(groups) > 1:
                    parts.append(Parallel(tuple(self._decompose(g) for g in groups)))
                elif len(segment) < len(nodes):
                    parts += self._decompose(segment).parts
                else:  # a tangle: no cut and no split; keep it whole, as one chain
                    parts += [self.children[i] for i in segment]
                segment = []
            if node is not None:
                parts.append(self.children[node])
        return Series(tuple(parts))

    def _components(self, nodes: list[int]) -> list[list[int]]:
        """Groups of ``nodes`` connected by dependencies among themselves, in order."""
        group_of: dict[int, int] = {}
        groups: list[list[int]] = []
        for node in nodes:
            linked = sorted({group_of[o] for o in group_of if self.comparable(o, node)})
            if not linked:
                group_of[node] = len(groups)
                groups.append([node])
                continue
            keep = linked[0]
            for other in linked[1:]:  # ``node`` joins groups that were apart until now
                for moved in groups[other]:
                    group_of[moved] = keep
                groups[keep] += groups[other]
                groups[other] = []
            group_of[node] = keep
            groups[keep].append(node)
        return [sorted(g) for g in groups if g]


def call_dag(call: CallRecord) -> CallDag:
    """Build the dependency DAG of ``call``'s children from the storages their ops touch."""
    children = call.children
    ancestors: list[frozenset[int]] = []
    producers: dict[int, frozenset[int]] = {}  # storage -> children its contents came from
    readers: dict[int, set[int]] = {}  # storage -> what read it since it was last written
    own_us = 0.0
    for item in call.items:
        if isinstance(item, ObservedOp):
            own_us += item.device_us
            found: set[int] = set()
            for key in item.reads:
                found |= producers.get(key, frozenset())
            for key in item.writes:
                found |= producers.get(key, frozenset()) | readers.get(key, set())
            for key in item.reads:
                readers.setdefault(key, set()).update(found)
            for key in (*item.writes, *item.fresh):
                producers[key] = frozenset(found)
                readers.pop(key, None)
            continue
        index = len(ancestors)
        mine: set[int] = set()  # storages this child allocated or wrote
        read: set[int] = set()
        found = set()
        for op in item.ops():
            for key in op.reads:
                if key not in mine:
                    found |= producers.get(key, frozenset())
                    read.add(key)
            for key in op.writes:
                if key not in mine:
                    found |= producers.get(key, frozenset()) | readers.get(key, set())
                    mine.add(key)
            mine.update(op.fresh)
        ancestors.append(frozenset(found))
        closure = frozenset(found | {index})
        for key in read - mine:
            readers.setdefault(key, set()).update(closure)
        for key in mine:
            producers[key] = closure
            readers.pop(key, None)
    return CallDag(children, tuple(ancestors), own_us)


@dataclass(frozen=True)
class RegionChoice:
    """Which branches of a :class:`Parallel` leave the caller's stream.

    Attributes:
        heaviest: index of the branch with the largest estimated device time; it stays on
            the caller's stream (one fork/join fewer) unless the planner's simulation
            found the step faster with it on a side stream too.
        leaving: indices of the branches worth a side stream, heaviest first.
    """

    heaviest: int
    leaving: tuple[int, ...]


class RegionRule:
    """Which groups of branches are regions, and which stages a call runs as.

    One instance per learning: every answer is cached by ``call_id`` (DAGs, their
    decompositions, stages), so the walk that places streams asks the same rule the region
    test used. Numbers are estimates on ``gpu``; ``fork_join_us`` is what a stage call costs
    the host.

    **A stage outlasts its fork/join.** A call on a side stream runs as the stages of
    :meth:`side_stages`: if a region inside it would be used and every link it would be
    split into (its kernel-launching child calls, recursively) is itself worth a stage, it
    is split into those links; otherwise it is one stage, its cheap links merged with their
    neighbours inside it, as long as it costs more than a fork/join; cheaper still, it is
    no stage at all and runs inline on the caller's stream. So no stage is estimated below
    its own fork/join, and a region inside a call is given up where using it would take a
    stage cheaper than that. (The planner may still run a region's cheap links as stages
    where its simulated step says that pays: ``linked`` in ``placement.assign_regions``.)
    """

    def __init__(
        self,
        gpu: ReferenceGPU,
        vetoed: frozenset[RegionKey] = frozenset(),
        moved: frozenset[RegionKey] = frozenset(),
    ) -> None:
        self.gpu = gpu
        self.vetoed = vetoed  # regions the planner's simulation found not worth it
        self.moved = moved  # regions whose heaviest branch the simulation moved off
        self._dags: dict[int, CallDag] = {}
        self._series: dict[int, Series] = {}
        self._region: dict[int, bool] = {}
        self._split: dict[int, bool] = {}
        self._stages: dict[int, tuple[CallRecord, ...]] = {}

    def dag(self, call: CallRecord) -> CallDag:
        """The (cached) child DAG of ``call``."""
        if call.call_id not in self._dags:
            self._dags[call.call_id] = call_dag(call)
        return self._dags[call.call_id]

    def series(self, call: CallRecord) -> Series:
        """The (cached) decomposition of ``call``'s child DAG."""
        if call.call_id not in self._series:
            self._series[call.call_id] = self.dag(call).series()
        return self._series[call.call_id]

    def has_region(self, call: CallRecord) -> bool:
        """Whether a region exists anywhere inside ``call`` (streams aside)."""
        if call.call_id not in self._region:
            here = any(self.choose(p) for p in parallels(self.series(call)))
            self._region[call.call_id] = here or any(self.has_region(c) for c in call.children)
        return self._region[call.call_id]

    def splits(self, call: CallRecord) -> bool:
        """Whether ``call``, on a side stream, runs as its links rather than as one stage."""
        if call.call_id not in self._split:
            # Split only for a region that will be used: links without one add forks only.
            used = any(self.choose(p) for p in parallels(self.series(call))) or any(
                self.splits(c) for c in call.children
            )
            self._split[call.call_id] = used and all(
                self.side_stages(c) for c in call.children if c.device_us > 0
            )
        return self._split[call.call_id]

    def side_stages(self, call: CallRecord) -> tuple[CallRecord, ...]:
        """The stage calls ``call`` runs as on a side stream (none: it runs inline)."""
        if call.call_id not in self._stages:
            if self.splits(call):
                found = tuple(s for c in call.children for s in self.side_stages(c))
            elif call.device_us > self.gpu.fork_join_us:
                found = (call,)
            else:  # a fork would outlast it (a call that launches no kernel included)
                found = ()
            self._stages[call.call_id] = found
        return self._stages[call.call_id]

    def choose(self, parallel: Parallel) -> RegionChoice | None:
        """Decide whether ``parallel`` is a region worth running on several streams.

        The rule: a branch may leave the caller's stream only if the device time of the
        stages it would run as (:meth:`side_stages` of its calls, every link of a split
        call counted) is larger than what leaving costs the host, ``gpu.fork_join_us`` per
        stage; a cheaper branch would finish before the host is done forking and joining
        it, so it could not overlap anything. The heaviest branch stays on the
        caller's stream (unless its region is in ``moved``: the planner simulated both
        placements and the step was faster with it on a side stream). The group is a
        region when at least one other branch is worth leaving. With the default
        :data:`ooo_wrap._planner.cost.H200` reference GPU, ``fork_join_us`` is 10 µs (a
        typical eager figure, not a measurement), so every stage of a leaving branch is
        estimated above 10 µs of device time (the stages the rule gives it: the planner
        adds cheaper links only where its simulated step pays for them).

        Returns:
            The :class:`RegionChoice`, or ``None`` when the branches stay on one stream.
        """
        costs = [branch.device_us for branch in parallel.branches]
        if len(costs) < 2 or region_key(parallel) in self.vetoed:
            return None
        heaviest = max(range(len(costs)), key=lambda i: costs[i])
        leaving = [
            i
            for i, branch in enumerate(parallel.branches)
            if i != heaviest and self.worth_leaving(branch)
        ]
        if not leaving:
            return None
        if region_key(parallel) in self.moved and self.worth_leaving(parallel.branches[heaviest]):
            leaving.append(heaviest)
        leaving.sort(key=lambda i: -costs[i])
        return RegionChoice(heaviest, tuple(leaving))

    def worth_leaving(self, branch: Series) -> bool:
        """Whether ``branch``'s stages outlast their forks and joins (see :meth:`choose`)."""
        stages = [stage for call in branch.calls() for stage in self.side_stages(call)]
        moved = sum(stage.device_us for stage in stages)
        return bool(stages) and moved > self.gpu.fork_join_us * len(stages)


RegionKey = tuple[int, ...]


def region_key(parallel: Parallel) -> RegionKey:
    """Names a group of branches across walks: the ``call_id`` of each branch's first call."""
    return tuple(next(branch.calls()).call_id for branch in parallel.branches)


def parallels(series: Series) -> list[Parallel]:
    """The groups of branches in ``series``, those nested in its branches included."""
    found: list[Parallel] = []
    for part in series.parts:
        if isinstance(part, Parallel):
            found.append(part)
            for branch in part.branches:
                found += parallels(branch)
    return found


def choose(parallel: Parallel, gpu: ReferenceGPU) -> RegionChoice | None:
    """:meth:`RegionRule.choose` for one group of branches (the rule is documented there)."""
    return RegionRule(gpu).choose(parallel)
