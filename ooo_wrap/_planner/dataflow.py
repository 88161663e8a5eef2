"""A plan learned from one observed forward: regions, stages, streams, dataflow edges, estimates.

:func:`learn` turns a :class:`~ooo_wrap._planner.observe.CallRecord` into a :class:`LearnedPlan`;
:func:`learn_plan` observes one forward of a model first. Both are pure: no stream, no event,
no device work beyond running the forward once (on the CPU or the ``meta`` device).
:meth:`LearnedPlan.to_plan` gives the :class:`~ooo_wrap._plan.Plan` the scheduler runs.

Every time here is an estimate from the cost model on a named reference GPU, never a
measurement. Step times come from the step simulator the race checker reports with
(``ooo_wrap._planner.simulate``: host launches and fork/joins, streams with their waits, a backward
modelled from the forward, concurrent kernels sharing the GPU by occupancy). A region is
kept only if the simulated step is faster with it than without it, by at least
``MIN_GAIN_FRACTION`` of the region's estimated step time and ``MIN_GAIN_US``; a plan
no faster than one stream is not learned (``no_parallelism``). With ``graphed=True`` every
step is priced as a CUDA graph replay (no per-kernel launch, forks and joins as graph
edges; ``simulate`` says how), and so is the region rule: no stage is below a fork/join
that costs the host nothing, and no branch is host-bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from .._plan import StepEstimate, as_stage_names, check_streams
from .cost import H200, ReferenceGPU
from .learned_plan import (
    LearnedPlan,
    LearnedStage,
    Outcome,
    RejectedRegion,
    StageEdge,
    edges_between_stages,
    stream_name,
)
from .observe import CallRecord, observe
from .placement import (
    RegionPlacement,
    RegionWalk,
    assign_named,
    assign_regions,
    named_chain,
)
from .regions import RegionKey, RegionRule, call_dag, parallels
from .simulate import BACKWARD_FACTOR, estimate_arm, simulate, step_ops
from .static import static_plan

__all__ = [
    "BACKWARD_FACTOR",
    "MIN_GAIN_FRACTION",
    "MIN_GAIN_US",
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


def learn(
    record: CallRecord,
    streams: int = 4,
    *,
    gpu: ReferenceGPU = H200,
    stages: Sequence[str] | None = None,
    by_simulation: bool = True,
    graphed: bool = False,
) -> LearnedPlan:
    """Learn a plan from one observed forward.

    Args:
        record: the root call, from :func:`~ooo_wrap._planner.observe.observe`.
        streams: the most side streams to use.
        gpu: the reference GPU of the op costs (for the region rule and the estimates).
        stages: dotted names of stages the user chose; kept as written, streams learned.
        by_simulation: keep a region only where the simulated step pays for it, so that a
            plan the estimate says is slower than one stream is never learned (the default:
            the plan runs as learned); ``False``: every region the region rule finds (the
            candidates that measured tuning races, or a pinned arm runs).
        graphed: price every step as a CUDA graph replay (the step is captured with
            ``graphed_step`` or ``make_graphed_callables``) instead of eager launches.

    Returns:
        The :class:`LearnedPlan`.
    """
    max_streams = check_streams(streams)
    notes: list[str] = []
    outcome: Outcome
    estimate: StepEstimate | None = None
    rejected: tuple[RejectedRegion, ...] = ()
    unfit = ""
    chain_of_named: tuple[str, ...] = ()
    rule_gpu = _replayed(gpu) if graphed else gpu  # what the region rule prices with
    if stages is None:
        unfit = _best_unfit(record, rule_gpu)
        walk, wanted, estimate, rejected, notes = _decide(
            record, max_streams, gpu, by_simulation, graphed
        )
    else:
        walk = assign_regions(record, max_streams, rule_gpu)
    if stages is not None:
        names = as_stage_names(stages, "stages=")
        wanted = assign_named(record, names, max_streams)
        chain_of_named = named_chain(record, names)
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
    chain = _longest_chain(record)
    return LearnedPlan(
        stages=learned,
        regions=regions if outcome == "parallel" else (),
        edges=tuple(edges_between_stages(record, stream_of, walk.lanes)),
        max_streams=max_streams,
        outcome=outcome,
        longest_chain=tuple(call.name for call in chain),
        chain_us=sum(call.device_us for call in chain),
        gpu=gpu.name,
        forward_us=record.device_us,
        plan_forward_us=plan_forward_us,
        fork_join_us=stage_calls * rule_gpu.fork_join_us,
        notes=tuple(notes),
        record=record,
        lanes=dict(walk.lanes),
        estimate=estimate,
        rejected=rejected,
        unfit=unfit,
        named_chain=chain_of_named,
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


def _replayed(gpu: ReferenceGPU) -> ReferenceGPU:
    """``gpu`` as a CUDA graph replay prices a kernel and a stage: no host launch, and a
    fork or join that is a graph edge, with no host time."""
    return replace(gpu, launch_us=0.0, fork_join_us=0.0)


def _placed(
    record: CallRecord, walk: RegionWalk
) -> tuple[dict[str, int], dict[int, int], list[str]]:
    """The stages a walk makes (module -> stream), their calls' streams, and notes."""
    notes: list[str] = []
    wanted = _one_stream_per_module(record, walk.stage_stream, notes)
    ids = {c.call_id: wanted[c.name] for c in record.calls() if c.name in wanted}
    return wanted, ids, notes


def _decide(
    record: CallRecord, streams: int, gpu: ReferenceGPU, judge: bool, graphed: bool
) -> tuple[RegionWalk, dict[str, int], StepEstimate, tuple[RejectedRegion, ...], list[str]]:
    """Keep each region only where the simulated step pays for it (the module doc).

    Regions are tried one at a time in the order found (outer before inner), each
    region's heaviest branch on the caller's stream, as placed and with the cheap links of
    its leaving branches as stages too (kept only if faster: a link left inline on the
    caller's stream can hold up the backward queued there). The step is simulated without
    the region, and the region is dropped unless it saves what it must. Where it takes the
    streams of regions inside it (they are placed without it, not with it), it must be
    faster than the step with them and save what it must against the step with neither.

    Then, in each region kept, the step is simulated with its heaviest branch on a side
    stream too; it moves only if that is faster (else it stays, one fork/join fewer). A
    plan no faster than one stream keeps no stage.
    """
    serial = estimate_arm(record, {}, gpu, graphed=graphed).one_stream_us
    rule_gpu = _replayed(gpu) if graphed else gpu

    def trial(
        vetoed: frozenset[RegionKey],
        moved: frozenset[RegionKey],
        linked: frozenset[RegionKey],
        same: _Trial | None = None,
    ) -> _Trial:
        """The placement's simulated step (``same`` itself if it places the same stages)."""
        walk = assign_regions(record, streams, rule_gpu, vetoed, moved, linked)
        wanted, ids, notes = _placed(record, walk)
        if same is not None and ids == same.ids:
            return same
        us = simulate(step_ops(record, ids, gpu, graphed=graphed)).length_us if ids else serial
        return _Trial(walk, wanted, ids, notes, us, vetoed, linked)

    def linking(plain: _Trial, key: RegionKey) -> _Trial:
        """``plain``, or it with region ``key``'s cheap links as stages if that is faster."""
        joined = trial(plain.vetoed, moved, plain.linked | {key}, same=plain)
        return joined if joined.us < plain.us - MIN_GAIN_US else plain

    moved: frozenset[RegionKey] = frozenset()
    best = trial(frozenset(), moved, frozenset())
    placements: dict[RegionKey, tuple[float, float]] = {}  # step: heaviest on caller, on side
    tried: set[RegionKey] = set()
    rejected: list[RejectedRegion] = []
    while judge:
        todo = [r for r in best.walk.regions if r.key not in tried]
        if not todo:
            break
        region = todo[0]
        tried.add(region.key)
        vetoed, linked = best.vetoed, best.linked
        kept = linking(best, region.key)
        without = trial(vetoed | {region.key}, moved, linked)
        needed = _needed(region)
        # Inner regions it displaces (those inside it placed without it, but not with it:
        # it took their streams) are not part of the step it must beat by its margin,
        # only of the step it must beat at all.
        displaced = frozenset(_nested(record, region, without.walk.regions)) - {
            r.key for r in kept.walk.regions
        }
        if displaced:
            neither = trial(vetoed | displaced | {region.key}, moved, linked, same=without)
            pays = kept.us < without.us - MIN_GAIN_US and neither.us - kept.us >= needed
        else:
            pays = without.us - kept.us >= needed
        if pays:
            best = kept
            continue
        rejected.append(RejectedRegion(region, kept.us, without.us, needed))
        best = without
    for key in [r.key for r in best.walk.regions] if judge else []:
        side = trial(best.vetoed, moved | {key}, best.linked)
        if side.ids == best.ids:  # its heaviest branch is not worth a stream of its own
            continue
        placements[key] = (best.us, side.us)
        # Faster by more than a rounding of the estimate: else one fork/join fewer.
        if side.us < best.us - MIN_GAIN_US:
            moved, best = moved | {key}, side
    walk, wanted, notes = best.walk, best.wanted, best.notes
    walk.regions = [
        _explain_heaviest(r, placements.get(r.key), r.key in moved, gpu) for r in walk.regions
    ]
    us = best.us if wanted else serial
    if wanted and judge and us >= serial:
        notes.append(
            f"the plan's simulated step ({us:.1f} µs) is no faster than one stream "
            f"({serial:.1f} µs): no stage kept"
        )
        wanted, us = {}, serial
    estimate = StepEstimate(us, serial, gpu.name, graphed=graphed)
    return walk, wanted, estimate, tuple(rejected), notes


def _needed(region: RegionPlacement) -> float:
    """What ``region`` must save of the simulated step to be kept (the module doc)."""
    region_us = sum(b.device_us for b in region.branches) * (1 + BACKWARD_FACTOR)
    return max(MIN_GAIN_US, MIN_GAIN_FRACTION * region_us)


def _nested(
    record: CallRecord, region: RegionPlacement, regions: Sequence[RegionPlacement]
) -> set[RegionKey]:
    """The keys of ``regions`` inside ``region``'s branches: under the calls of its
    branches, by call, not by module (a module may be called again elsewhere)."""
    ids = {i for branch in region.branches for i in branch.call_ids}
    inside = {c.call_id for top in record.calls() if top.call_id in ids for c in top.calls()}
    return {r.key for r in regions if r.key != region.key and r.key and r.key[0] in inside}


@dataclass(frozen=True)
class _Trial:
    """One placement the planner simulated: the walk, its stages and the simulated step."""

    walk: RegionWalk
    wanted: dict[str, int]
    ids: dict[int, int]
    notes: list[str]
    us: float
    vetoed: frozenset[RegionKey]  # regions it left out
    linked: frozenset[RegionKey]  # regions whose cheap links it ran as stages


def _explain_heaviest(
    region: RegionPlacement, steps: tuple[float, float] | None, moved: bool, gpu: ReferenceGPU
) -> RegionPlacement:
    """Say in the heaviest branch's row where the simulation put it, with both steps."""
    if steps is None:
        return region
    heaviest = max(range(len(region.branches)), key=lambda i: region.branches[i].device_us)
    caller, side = steps
    where = "moved to a side stream" if moved else "kept"
    why = (
        f"heaviest branch {where}: estimated step {side:.1f} µs with it on a side stream, "
        f"{caller:.1f} µs on the caller's ({gpu.name})"
    )
    branches = list(region.branches)
    branches[heaviest] = replace(branches[heaviest], why=why)
    return replace(region, branches=tuple(branches))


def learn_plan(
    model: nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    streams: int = 4,
    stages: Sequence[str] | None = None,
    gpu: ReferenceGPU = H200,
    by_simulation: bool = True,
    graphed: bool = False,
) -> LearnedPlan:
    """Run one forward of ``model`` under observation and learn its plan (see :func:`learn`).

    Raises:
        OOOConfigError: ``streams`` is not a positive int, or a name in ``stages`` is
            unknown, repeated or overlaps another (as for :func:`ooo_wrap.plan`).

    Example::

        >>> learned = learn_plan(model, (torch.randn(8, 3, 32, 32),), streams=4)
        >>> print(learned)
    """
    static_plan(
        model, check_streams(streams), stages
    )  # the same errors as the static plan, before running
    record = observe(model, example_inputs, example_kwargs, gpu=gpu)
    return learn(
        record, streams, gpu=gpu, stages=stages, by_simulation=by_simulation, graphed=graphed
    )


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
        where = ", ".join(stream_name(s) for s in sorted(seen, key=str))
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
