"""What the dataflow planner learned, as frozen records, and how it prints as a table.

:class:`LearnedPlan` is what :func:`~ooo_wrap._planner.dataflow.learn` returns: regions,
stages, dataflow edges and estimates; :meth:`LearnedPlan.to_plan` gives the
:class:`~ooo_wrap._plan.Plan` the scheduler runs, and ``str()`` gives its table.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from torch import nn

from .._plan import Plan, StageSource, StepEstimate, plural
from .cost import ReferenceGPU
from .observe import CallRecord
from .placement import BranchPlacement, Lane, RegionPlacement, stage_edges
from .simulate import estimate_arm
from .static import static_plan

__all__ = [
    "LearnedPlan",
    "LearnedStage",
    "Outcome",
    "RejectedRegion",
    "StageEdge",
    "edges_between_stages",
    "format_chain",
    "learned_of",
    "render",
    "stream_name",
]

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
class RejectedRegion:
    """A region the simulated step did not pay for: its branches, and the estimated µs of
    the step with it, without it, and what it had to save."""

    region: RegionPlacement
    with_us: float
    without_us: float
    needed_us: float

    def __str__(self) -> str:
        branches = ", ".join(f"{b.device_us:.1f}" for b in self.region.branches)
        return f"region {self.region.name} (branches {branches} µs forward) {self.effect}"

    @property
    def effect(self) -> str:
        """What the region would do to the simulated step, and what it had to save."""
        saved = self.without_us - self.with_us
        effect = f"save {saved:.1f} µs of" if saved >= 0 else f"add {-saved:.1f} µs to"
        return (
            f"would {effect} a {self.without_us:.1f} µs step; it must save {self.needed_us:.1f} µs"
        )

    def why(self, branch: BranchPlacement) -> str:
        """Why ``branch`` stays on the caller's stream, the region being rejected: what
        bounds it (its launches, the GPU's share its kernels and the others' ask for), or
        what the simulated step saved."""
        if branch.device_us <= branch.launch_us:
            return (
                f"host-bound: {branch.device_us:.1f} µs of kernels, "
                f"{branch.launch_us:.1f} µs to launch them"
            )
        share = sum(b.occupancy for b in self.region.branches)
        if share >= 1.0:
            return f"the GPU already full: the branches' kernels ask for {share:.2f} of it"
        saved = self.without_us - self.with_us
        return f"saves {saved:.1f} µs of the step, under the {self.needed_us:.1f} µs it must"


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
        named_chain: for named stages whose calls form one chain (each reads what the one
            before it wrote), their calls in order; else empty.
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
    chain_us: float = 0.0  # estimated forward device time of ``longest_chain``
    named_chain: tuple[str, ...] = ()

    @property
    def stage_streams(self) -> dict[str, int]:
        return {stage.name: stage.stream for stage in self.stages}

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
            f"longest chain: {format_chain(self.longest_chain)}, {self.chain_us:.1f} µs of "
            f"the {self.forward_us:.1f} µs forward"
        )

    @property
    def named_chain_message(self) -> str:
        """The message for a ``PLANNED``/``named_chain`` event (and the table's line): named
        stages that cannot overlap each other, and why they keep their hooks."""
        return (
            f"the named stages form one chain ({format_chain(self.named_chain)}): each reads "
            "what the one before it wrote, so none of them can overlap another; they keep "
            "their hooks, as named (only work of the caller's that does not depend on them "
            "can overlap them): expect the hooks' cost and little gain. Measured tuning "
            "(tune='auto' on an accelerator) removes the hooks if the step is slower with "
            "them; or leave the stage names out (stages=, ooo_stage_names) to let the planner "
            "decide (finding no parallel region, it removes every hook)"
        )

    def arm(self, gpu: ReferenceGPU, *, split: bool = False, graphed: bool = False) -> StepEstimate:
        """This plan's stages on their streams, priced by ``simulate.estimate_arm`` on the
        forward it was learned from (``estimate`` is this, priced as learned, without
        the split, for a plan the simulator judged); ``gpu`` is the reference it learned on."""
        streams = self.stage_streams
        ids = {c.call_id: streams[c.name] for c in self.record.calls() if c.name in streams}
        return estimate_arm(self.record, ids, gpu, split=split, graphed=graphed)

    def to_plan(self, model: nn.Module, source: StageSource = "dataflow") -> Plan:
        """The :class:`Plan` for the scheduler: these stages, on these streams (none for
        ``no_parallelism``), with this learned plan attached for its table."""
        if not self.stages:
            return Plan(stages=(), max_streams=self.max_streams, source=source, learned=self)
        base = static_plan(model, self.max_streams, [stage.name for stage in self.stages])
        streams = self.stage_streams
        stages = tuple(replace(stage, stream=streams[stage.name]) for stage in base.stages)
        return Plan(stages=stages, max_streams=self.max_streams, source=source, learned=self)

    def __str__(self) -> str:
        return render(self)


def edges_between_stages(
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


def format_chain(names: tuple[str, ...], limit: int = 6) -> str:
    """``a -> b -> ... -> z (n calls)``: a chain of calls, shortened past ``limit``."""
    shown = [name or "<root>" for name in names]
    if len(shown) > limit:
        shown = [*shown[: limit - 2], "...", shown[-1]]
    return " -> ".join(shown) + f" ({len(names)} calls)"


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def stream_name(stream: int | None) -> str:
    """``side1`` for side stream 0, ... (as ``Stage.stream_name``); ``caller`` for ``None``."""
    return "caller" if stream is None else f"side{stream + 1}"


def render(learned: LearnedPlan) -> str:
    """Several lines: outcome, estimates (labelled), every candidate region with its
    branches (their streams, or why they stay on the caller's), edges."""
    streams = len({stage.stream for stage in learned.stages})
    lines = [
        f"Learned plan ({learned.outcome}): {plural(len(learned.stages), 'stage')} in "
        f"{plural(len(learned.regions), 'region')} on {plural(streams, 'side stream')} "
        f"(max {learned.max_streams})"
    ]
    if learned.outcome == "no_parallelism":
        lines.append(f"  nothing to overlap: {learned.no_parallelism_message}")
    if learned.estimate is not None:
        lines.append(f"  {learned.estimate}")
        how = (
            "one graph launch, no per-kernel launch, fork/joins as graph edges"
            if learned.estimate.graphed
            else f"host launches and fork/joins ({learned.fork_join_us:.1f} µs per forward)"
        )
        lines.append(
            f"    (simulated: {how}, backward from the forward, kernels sharing the GPU by "
            "occupancy)"
        )
    else:
        lines.append(
            f"  estimate on {learned.gpu}: forward {learned.forward_us:.1f} µs on one stream"
        )
    if learned.regions or learned.rejected:
        lines.append(f"  candidate regions (est. µs: forward estimates on {learned.gpu}):")
    stage_us = {stage.name: stage for stage in learned.stages}
    for region in learned.regions:
        lines.append(f"  region {region.name} (width {region.width}): kept")
        rows: list[tuple[str, ...]] = [("branch", "call", "stream", "est. µs", "stage calls")]
        notes: list[str] = []
        for index, branch in enumerate(region.branches):
            for name, us in zip(branch.calls, branch.call_us, strict=True):
                stage = stage_us.get(name)
                if stage is not None:
                    rows.append(
                        (str(index), name, stream_name(stage.stream), f"{us:.1f}", str(stage.calls))
                    )
                    continue
                inner = any(s.startswith(name + ".") for s in stage_us) if name else bool(stage_us)
                where = "split" if inner and branch.stream is not None else "caller"
                rows.append((str(index), f"({name})", where, f"{us:.1f}", "-"))
            if branch.why:
                notes.append(f"    branch {index}: {branch.why}")
        lines += _table(rows) + notes
    for rejected in learned.rejected:
        region = rejected.region
        lines.append(
            f"  region {region.name} (width {region.width}): rejected, it {rejected.effect} "
            f"(an estimate on {learned.gpu})"
        )
        rows = [("branch", "calls", "est. µs", "stays on the caller's stream because")]
        for index, branch in enumerate(region.branches):
            below = branch.why.startswith("below")  # the rule's reason, before any simulation
            why = branch.why if below else rejected.why(branch)
            rows.append((str(index), ", ".join(branch.calls), f"{branch.device_us:.1f}", why))
        lines += _table(rows)
    if learned.named_chain:
        lines.append(f"  {learned.named_chain_message}")
    if learned.outcome == "named":
        named: list[tuple[str, ...]] = [("stage", "stream", "est. µs", "calls")]
        named += [
            (s.name, stream_name(s.stream), f"{s.device_us:.1f}", str(s.calls))
            for s in learned.stages
        ]
        lines += _table(named)
    pairs = Counter(
        (e.producer, e.consumer, e.producer_stream, e.consumer_stream) for e in learned.edges
    )
    if pairs:
        lines.append("  dataflow edges between stages (per forward):")
        for (producer, consumer, a, b), count in pairs.items():
            times = f" x{count}" if count > 1 else ""
            lines.append(
                f"    {producer} [{stream_name(a)}] -> {consumer} [{stream_name(b)}]{times}"
            )
    lines += [f"  note: {note}" for note in learned.notes]
    return "\n".join(lines)


def learned_of(plan: Plan) -> LearnedPlan | None:
    """The dataflow planner's record of ``plan``, ``None`` for a plan it did not learn."""
    return plan.learned if isinstance(plan.learned, LearnedPlan) else None
