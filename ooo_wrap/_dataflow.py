"""A plan learned from one observed forward: regions, stages, streams, dataflow edges, estimates.

:func:`learn` turns a :class:`~ooo_wrap._observe.CallRecord` into a :class:`LearnedPlan`;
:func:`learn_plan` observes one forward of a model first. Both are pure: no stream, no event,
no device work beyond running the forward once (on the CPU or the ``meta`` device).
:meth:`LearnedPlan.to_plan` gives the :class:`~ooo_wrap._plan.Plan` the scheduler runs.

Every time here is an estimate from the cost model on a named reference GPU, never a
measurement. Step times come from the step simulator the race checker reports with
(``ooo_wrap._simulate``: host launches and fork/joins, streams with their waits, a backward
modelled from the forward, concurrent kernels sharing the GPU by occupancy). A region is
kept only if the simulated step is faster with it than without it, by at least
``MIN_GAIN_FRACTION`` of the region's estimated step time and ``MIN_GAIN_US``; a plan
no faster than one stream is not learned (``no_parallelism``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from torch import nn

from ._cost import H200, ReferenceGPU
from ._dataflow_table import format_chain, render
from ._observe import CallRecord, observe
from ._plan import Plan, StageSource, as_stage_names, check_streams, plan
from ._regions import RegionKey, RegionRule, call_dag, parallels
from ._simulate import BACKWARD_FACTOR, StepEstimate, simulate, step_ops
from ._streams import (
    Lane,
    RegionPlacement,
    RegionWalk,
    assign_named,
    assign_regions,
    stage_edges,
)

__all__ = [
    "BACKWARD_FACTOR",
    "MIN_GAIN_FRACTION",
    "MIN_GAIN_US",
    "EdgeCount",
    "LearnedPlan",
    "LearnedStage",
    "RejectedRegion",
    "StageEdge",
    "learn",
    "learn_plan",
]

# What a region must save, by the simulated step, to be kept: this fraction of its own
# estimated step time (its branches' forward and backward), and at least this many µs.
MIN_GAIN_FRACTION = 0.02
MIN_GAIN_US = 1.0
# Whether regions are kept only where the simulated step pays for them, where ``learn`` is
# not told. Off: the simulator's occupancy model (concurrent kernels sharing the GPU) has
# not been compared with a GPU yet, and as a gate it would turn most models plain on a
# prediction; measured tuning decides on the device instead. Every region the region rule
# finds is kept, and the plan's estimate (the same simulator check() reports with) says
# what it is expected to cost.
BY_SIMULATION = False

Outcome = Literal["parallel", "no_parallelism", "named"]


@dataclass(frozen=True)
class LearnedStage:
    """A stage of a learned plan: estimated forward device time over all its calls."""

    name: str
    stream: int
    calls: int
    device_us: float


@dataclass(frozen=True)
class StageEdge:
    """Data flowing from one stage call to another (through the caller's stream or not).

    ``chain_link``: both calls are links of one chain (the same branch of the same region,
    or both outside every region); such an edge across streams splits a chain.
    """

    producer: str
    consumer: str
    producer_stream: int
    consumer_stream: int
    chain_link: bool

    @property
    def cross_stream(self) -> bool:
        return self.producer_stream != self.consumer_stream


@dataclass(frozen=True)
class EdgeCount:
    """Stage-to-stage dataflow edges of one forward: all, across streams, splitting a chain."""

    edges: int
    cross_stream: int
    chain_splits: int


@dataclass(frozen=True)
class RejectedRegion:
    """A region the simulated step did not pay for: its branches, and the estimated µs of
    the step with it, without it, and what it had to save."""

    region: RegionPlacement
    with_us: float
    without_us: float
    needed_us: float

    def __str__(self) -> str:
        branches = ", ".join(f"{b.device_us:.1f}" for b in self.region.branches)
        saved = self.without_us - self.with_us
        effect = f"save {saved:.1f} µs of" if saved >= 0 else f"add {-saved:.1f} µs to"
        return (
            f"region {self.region.name or '<root>'} (branches {branches} µs forward) would "
            f"{effect} a {self.without_us:.1f} µs step; it must save {self.needed_us:.1f} µs"
        )


@dataclass(frozen=True)
class LearnedPlan:
    """The plan learned from one forward (see the module docstring for the estimates).

    Attributes:
        stages: the stages in order of first call.
        regions: every parallel region found, with its branches and their streams (empty
            for named stages, whose streams come from another rule).
        edges: one per (producer call, consumer call) pair of stages, in program order.
        max_streams: the ``streams`` asked for.
        outcome: ``"parallel"``; ``"no_parallelism"`` when no region was found (nothing to
            overlap: the wrapper should stop calling its backend); ``"named"`` for stages
            the user named (kept as written, only their streams learned).
        longest_chain: the heaviest chain of calls from the root down (for a message).
        gpu: the reference GPU the estimates are for.
        forward_us, plan_forward_us: estimated forward device time on one stream and with
            this plan (``None`` for named stages: not estimated).
        fork_join_us: estimated host time of all stage calls' forks and joins per forward.
        notes: modules that were not made stages, and why.
        estimate: the simulated step with this plan against one stream (``None`` for named
            stages: not estimated).
        rejected: regions found but not kept, with their simulated numbers.
    """

    stages: tuple[LearnedStage, ...]
    regions: tuple[RegionPlacement, ...]
    edges: tuple[StageEdge, ...]
    max_streams: int
    outcome: Outcome
    longest_chain: tuple[str, ...]
    gpu: str
    forward_us: float
    plan_forward_us: float | None
    fork_join_us: float
    notes: tuple[str, ...]
    record: CallRecord = field(repr=False, compare=False)
    lanes: Mapping[int, Lane | None] = field(repr=False, compare=False)
    estimate: StepEstimate | None = None
    rejected: tuple[RejectedRegion, ...] = ()
    unfit: str = ""  # with no region found: the best candidate group of branches, and why

    @property
    def stage_streams(self) -> dict[str, int]:
        return {stage.name: stage.stream for stage in self.stages}

    @property
    def step_us(self) -> float:
        """Estimated step time (forward and backward) on one stream."""
        if self.estimate is not None:
            return self.estimate.one_stream_us
        return self.forward_us * (1 + BACKWARD_FACTOR)

    @property
    def plan_step_us(self) -> float | None:
        """Estimated step time with this plan (``None`` if not estimated)."""
        return None if self.estimate is None else self.estimate.wrapped_us

    @property
    def best_rejected(self) -> RejectedRegion | None:
        """The rejected region that came closest to paying for itself."""
        return max(self.rejected, key=lambda r: r.without_us - r.with_us, default=None)

    @property
    def no_parallelism_message(self) -> str:
        """The message for a ``DISABLED``/``no_parallelism`` event: the best rejected
        region with its numbers, and the longest chain."""
        best = self.best_rejected
        why = f"; best rejected: {best}" if best is not None else ""
        why = why or (f"; {self.unfit}" if self.unfit else "")
        return (
            f"no parallel region worth a side stream (estimated on {self.gpu}){why}; "
            f"longest chain: {format_chain(self.longest_chain)}"
        )

    def count_edges(self, stage_streams: Mapping[str, int]) -> EdgeCount:
        """Count the stage edges of any plan (e.g. the static one) on this forward."""
        edges = _edges(self.record, stage_streams, self.lanes)
        cross = [e for e in edges if e.cross_stream]
        return EdgeCount(len(edges), len(cross), sum(e.chain_link for e in cross))

    def to_plan(self, model: nn.Module, source: StageSource = "dataflow") -> Plan:
        """The :class:`Plan` for the scheduler: these stages, on these streams (none for
        ``no_parallelism``), with this learned plan attached for its table."""
        if not self.stages:
            return Plan(stages=(), max_streams=self.max_streams, source=source, learned=self)
        base = plan(model, self.max_streams, stages=[stage.name for stage in self.stages])
        streams = self.stage_streams
        stages = tuple(replace(stage, stream=streams[stage.name]) for stage in base.stages)
        return Plan(stages=stages, max_streams=self.max_streams, source=source, learned=self)

    def __str__(self) -> str:
        return render(self)


def learn(
    record: CallRecord,
    streams: int = 4,
    *,
    gpu: ReferenceGPU = H200,
    stages: Sequence[str] | None = None,
    by_simulation: bool | None = None,
) -> LearnedPlan:
    """Learn a plan from one observed forward.

    Args:
        record: the root call, from :func:`~ooo_wrap._observe.observe`.
        streams: the most side streams to use.
        gpu: the reference GPU of the op costs (for the region rule and the estimates).
        stages: dotted names of stages the user chose; kept as written, streams learned.
        by_simulation: keep a region only where the simulated step pays for it (``False``:
            every region the region rule finds, for tests of plan structure; ``None``:
            ``BY_SIMULATION``).

    Returns:
        The :class:`LearnedPlan`.
    """
    max_streams = check_streams(streams)
    notes: list[str] = []
    outcome: Outcome
    estimate: StepEstimate | None = None
    rejected: tuple[RejectedRegion, ...] = ()
    unfit = ""
    if stages is None:
        unfit = _best_unfit(record, gpu)
        walk, wanted, estimate, rejected, notes = _decide(
            record, max_streams, gpu, BY_SIMULATION if by_simulation is None else by_simulation
        )
    else:
        walk = assign_regions(record, max_streams, gpu)
    if stages is not None:
        names = as_stage_names(stages, "stages=")
        wanted = assign_named(record, names, max_streams)
        for name in names:
            if name not in wanted:  # e.g. a training-only head: any stream will do
                wanted[name] = 0
                notes.append(f"{name} was not called in the observed forward: any stream will do")
        wanted = {name: wanted[name] for name in names}
        outcome, plan_forward_us = "named", None
    else:
        outcome = "parallel" if wanted else "no_parallelism"
        plan_forward_us = walk.forward_us
    renumber = {s: i for i, s in enumerate(dict.fromkeys(wanted.values()))}
    stream_of = {name: renumber[s] for name, s in wanted.items()}
    calls = [c for c in record.calls() if c.name in stream_of]
    totals: dict[str, list[float]] = {}
    for call in calls:
        totals.setdefault(call.name, []).append(call.device_us)
    learned = tuple(
        LearnedStage(name, stream_of[name], len(totals.get(name, [])), sum(totals.get(name, [])))
        for name in stream_of
    )
    regions = tuple(
        replace(
            region,
            branches=tuple(
                replace(b, stream=None if b.stream is None else renumber.get(b.stream))
                for b in region.branches
            ),
        )
        for region in walk.regions
    )
    stage_calls = sum(stage.calls for stage in learned)
    return LearnedPlan(
        stages=learned,
        regions=regions if outcome == "parallel" else (),
        edges=tuple(_edges(record, stream_of, walk.lanes)),
        max_streams=max_streams,
        outcome=outcome,
        longest_chain=tuple(call.name for call in _longest_chain(record)),
        gpu=gpu.name,
        forward_us=record.device_us,
        plan_forward_us=plan_forward_us,
        fork_join_us=stage_calls * gpu.fork_join_us,
        notes=tuple(notes),
        record=record,
        lanes=dict(walk.lanes),
        estimate=estimate,
        rejected=rejected,
        unfit=unfit,
    )


def _best_unfit(record: CallRecord, gpu: ReferenceGPU) -> str:
    """The group of branches whose second-heaviest branch is heaviest, in words, if the
    region rule found it below its fork/joins (the reason no region was found)."""
    rule = RegionRule(gpu)
    best: tuple[float, str] | None = None
    for call in record.calls():
        for group in parallels(rule.series(call)):
            costs = sorted((b.device_us for b in group.branches), reverse=True)
            if len(costs) < 2 or rule.choose(group) is not None:
                continue
            if best is None or costs[1] > best[0]:
                shown = ", ".join(f"{c:.1f}" for c in costs)
                best = (
                    costs[1],
                    f"best candidate: {len(costs)} branches in {call.name or '<root>'} "
                    f"({shown} µs forward), each stage under its {gpu.fork_join_us:.1f} µs "
                    "fork/join",
                )
    return "" if best is None else best[1]


def _placed(
    record: CallRecord, walk: RegionWalk
) -> tuple[dict[str, int], dict[int, int], list[str]]:
    """The stages a walk makes (module -> stream), their calls' streams, and notes."""
    notes: list[str] = []
    wanted = _one_stream_per_module(record, walk.stage_stream, notes)
    ids = {c.call_id: wanted[c.name] for c in record.calls() if c.name in wanted}
    return wanted, ids, notes


def _decide(
    record: CallRecord, streams: int, gpu: ReferenceGPU, judge: bool
) -> tuple[RegionWalk, dict[str, int], StepEstimate, tuple[RejectedRegion, ...], list[str]]:
    """Keep each region only where the simulated step pays for it (the module doc).

    Regions are tried one at a time in the order found: the step is simulated without the
    region and the region is dropped unless it saves what it must. A plan no faster than
    one stream keeps no stage.
    """

    def wrapped(ids: Mapping[int, int]) -> float:
        return simulate(step_ops(record, ids, gpu)).length_us

    serial = simulate(step_ops(record, {}, gpu, one_stream=True)).length_us
    vetoed: set[RegionKey] = set()
    walk = assign_regions(record, streams, gpu)
    wanted, ids, notes = _placed(record, walk)
    best = wrapped(ids)
    tried: set[RegionKey] = set()
    rejected: list[RejectedRegion] = []
    while judge:
        todo = [r for r in walk.regions if r.key not in tried]
        if not todo:
            break
        region = todo[0]
        tried.add(region.key)
        trial = assign_regions(record, streams, gpu, frozenset(vetoed | {region.key}))
        trial_wanted, trial_ids, trial_notes = _placed(record, trial)
        without = wrapped(trial_ids) if trial_ids else serial
        region_us = sum(b.device_us for b in region.branches) * (1 + BACKWARD_FACTOR)
        needed = max(MIN_GAIN_US, MIN_GAIN_FRACTION * region_us)
        if without - best >= needed:
            continue
        rejected.append(RejectedRegion(region, best, without, needed))
        vetoed.add(region.key)
        walk, wanted, ids, notes, best = trial, trial_wanted, trial_ids, trial_notes, without
    if not wanted or (judge and best >= serial):
        if wanted:
            notes.append(
                f"the plan's simulated step ({best:.1f} µs) is no faster than one stream "
                f"({serial:.1f} µs): no stage kept"
            )
        wanted, best = {}, serial
    return walk, wanted, StepEstimate(best, serial, gpu.name), tuple(rejected), notes


def learn_plan(
    model: nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    streams: int = 4,
    stages: Sequence[str] | None = None,
    gpu: ReferenceGPU = H200,
    by_simulation: bool | None = None,
) -> LearnedPlan:
    """Run one forward of ``model`` under observation and learn its plan (see :func:`learn`).

    Raises:
        OOOConfigError: ``streams`` is not a positive int, or a name in ``stages`` is
            unknown, repeated or overlaps another (as for :func:`ooo_wrap.plan`).

    Example::

        >>> learned = learn_plan(model, (torch.randn(8, 3, 32, 32),), streams=4)
        >>> print(learned)
    """
    plan(model, streams, stages=stages)  # the same errors as the static plan, before running
    record = observe(model, example_inputs, example_kwargs, gpu=gpu)
    return learn(record, streams, gpu=gpu, stages=stages, by_simulation=by_simulation)


def _one_stream_per_module(
    record: CallRecord, stage_stream: Mapping[int, int], notes: list[str]
) -> dict[str, int]:
    """A stage is a module: keep it only if every call of it got the same side stream."""
    placed: dict[str, set[int | None]] = {}
    for call in record.calls():
        placed.setdefault(call.name, set()).add(stage_stream.get(call.call_id))
    chosen: dict[str, int] = {}
    noted: set[str] = set()
    for call in record.calls():  # pre-order: the order of first calls
        if call.call_id not in stage_stream or call.name in chosen or call.name in noted:
            continue
        seen = placed[call.name]
        if len(seen) == 1:
            chosen[call.name] = stage_stream[call.call_id]
            continue
        noted.add(call.name)
        where = ", ".join("caller" if s is None else str(s) for s in sorted(seen, key=str))
        notes.append(f"{call.name} runs inline: its calls were placed on streams {where}")
    return chosen


def _longest_chain(record: CallRecord) -> list[CallRecord]:
    """The heaviest chain of child calls, descending through single-child wrappers."""
    call = record
    while True:
        chain = call_dag(call).heaviest_chain()
        if len(chain) != 1 or not chain[0].children:
            return chain
        call = chain[0]


def _edges(
    record: CallRecord, stage_streams: Mapping[str, int], lanes: Mapping[int, Lane | None]
) -> list[StageEdge]:
    parent: dict[int, CallRecord] = {}
    by_id: dict[int, CallRecord] = {}
    for call in record.calls():
        by_id[call.call_id] = call
        for child in call.children:
            parent[child.call_id] = call

    def lane(call_id: int) -> Lane | None:
        while call_id not in lanes and call_id in parent:
            call_id = parent[call_id].call_id
        return lanes.get(call_id)

    stage_ids = _stage_call_ids(record, stage_streams)
    found = []
    for producer, consumer in stage_edges(record, stage_ids):
        p, c = by_id[producer], by_id[consumer]
        found.append(
            StageEdge(
                p.name,
                c.name,
                stage_streams[p.name],
                stage_streams[c.name],
                chain_link=lane(producer) == lane(consumer),
            )
        )
    return found


def _stage_call_ids(call: CallRecord, names: Mapping[str, int]) -> set[int]:
    ids: set[int] = set()
    for child in call.children:
        ids |= {child.call_id} if child.name in names else _stage_call_ids(child, names)
    return ids
