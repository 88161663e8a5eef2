"""``CheckReport``: what ``check()`` found, readable, raisable and exportable as a trace."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import OOOError
from .._plan import StepEstimate, plural
from .._planner.cost import H200, ReferenceGPU
from ._picture import save_picture, step_spans
from ._timeline import Slot, Timeline, lay_out, split_steps
from ._tracker import AllocatorHazard, OpRecord, Race

__all__ = [
    "CheckFailed",
    "CheckReport",
    "ParityEntry",
    "StepEstimate",
    "StreamOps",
    "count_ops",
]


class CheckFailed(OOOError):
    """Raised by :meth:`CheckReport.raise_if_failed`; the message is the report."""


@dataclass(frozen=True)
class ParityEntry:
    """The largest absolute difference of one output or gradient against the plain run.

    Attributes:
        name: ``output``, ``output[0]``, ``output['logits']``, ... or ``grad:<param>``.
        max_abs_diff: over every step; ``0.0`` when bitwise equal, ``inf`` if a side is
            missing, has another shape or another dtype.
    """

    name: str
    max_abs_diff: float

    @property
    def exact(self) -> bool:
        """Whether the two runs agreed bit for bit (NaNs in the same places count)."""
        return self.max_abs_diff == 0.0


@dataclass(frozen=True)
class StreamOps:
    """How many ops one virtual stream ran in each phase (view ops launch none)."""

    stream: str
    forward: int
    backward: int
    step: int


@dataclass(frozen=True)
class CheckReport:
    """What :func:`ooo_wrap.testing.check` found.

    Attributes:
        races: unordered cross-stream accesses (each once per distinct pair of sites).
        allocator_hazards: tensors used on a stream they were never recorded to.
        parity: per output and per gradient, the largest difference from the plain copy.
        ops: ops per virtual stream per phase.
        trace: every op in order, for :meth:`save_trace`.
        notes: what the wrapper decided (e.g. why it fell back), one line each.
        steps: training steps run.
        captured: whether the last step ran under a simulated CUDA graph capture, whose
            rules held (a broken one raises ``CaptureError`` instead of reporting).
        overlap_forward: whether the wrapper was checked with deferred forward joins
            (``OOOModule(..., overlap_forward=True)``).
        not_checked: why nothing was checked, when the wrapper fell back (the model then
            ran with standard backward, so there were no side streams to check); ``None``
            when the wrapped model was checked.
        gpu: the reference GPU the timeline and :attr:`estimate` are estimated on.
        learning_step: the step (from 1) that ran inline while the ``dataflow`` planner
            learned the plan, marked in :meth:`save_timeline` and :meth:`save_trace`;
            ``None`` when no step did (the ``static`` planner).
        plan_estimate: the checked plan's estimate, as its table gives it (the learned
            forward's step with the checked streams, and the split if it was in force),
            or ``None`` for a plan learned from no forward (the ``static`` planner).
        graphed: the estimates are priced as a CUDA graph replay (``check(graphed=True)``).
        split: the weight-gradient split was in force (``split_weight_grads=True``).
        arms: the names of the arms proved (``("static", "wgrad", ...)``), each trained on
            its own copy pinned to it (``tune_arm=``); ``()`` when none was.
        by_arm: with several arms, each arm's own report, in :attr:`arms` order; ``()``
            for a report of one arm. ``races``, ``allocator_hazards`` and ``parity`` then
            cover every arm (parity: the largest difference of any arm); ``ops``,
            ``trace``, :attr:`estimate` and the saved trace and timeline are those of
            :attr:`shown_arm`.
        runs_plain: why the model runs plain with no candidate arm (nothing runs on a side
            stream, so nothing can race: the report is ``ok``); ``None`` otherwise.

    Example::

        >>> report = ooo_wrap.testing.check(model, x)
        >>> print(report)
        >>> report.raise_if_failed()
        >>> report.save_trace("trace.json")   # open in https://ui.perfetto.dev
        >>> report.save_timeline("timeline.svg")
    """

    races: tuple[Race, ...]
    allocator_hazards: tuple[AllocatorHazard, ...]
    parity: tuple[ParityEntry, ...]
    ops: tuple[StreamOps, ...]
    trace: tuple[OpRecord, ...]
    notes: tuple[str, ...]
    steps: int
    captured: bool = False
    not_checked: str | None = None
    overlap_forward: bool = False
    gpu: ReferenceGPU = H200
    learning_step: int | None = None
    plan_estimate: StepEstimate | None = None
    graphed: bool = False
    split: bool = False
    arms: tuple[str, ...] = ()
    by_arm: tuple[CheckReport, ...] = ()
    runs_plain: str | None = None

    @property
    def ok(self) -> bool:
        """Every arm was checked, with no race, no allocator hazard, and bitwise parity
        with the plain run; or the model runs plain, with no arm to check."""
        return (
            self.not_checked is None
            and not self.races
            and not self.allocator_hazards
            and all(entry.exact for entry in self.parity)
            and all(report.ok for report in self.by_arm)
        )

    @property
    def shown_arm(self) -> str | None:
        """The arm whose ops, trace and timeline the report shows: the first that is not
        ok, else the first (the simulator's best estimate)."""
        parts = self._parts()
        return next((name for name, part in parts if not part.ok), parts[0][0])

    def _parts(self) -> tuple[tuple[str | None, CheckReport], ...]:
        """``(arm, its report)`` for each arm; a report of one arm is its own part."""
        if self.by_arm:
            return tuple(zip(self.arms, self.by_arm, strict=True))
        return ((self.arms[0] if self.arms else None, self),)

    def arm_report(self, name: str) -> CheckReport:
        """The report of the arm ``name`` (one of :attr:`arms`)."""
        found = dict(self._parts())
        if name not in found:
            raise OOOError(f"no arm {name!r} in this report; its arms are {', '.join(self.arms)}")
        return found[name]

    def _shown(self) -> CheckReport:
        return dict(self._parts())[self.shown_arm]

    def __str__(self) -> str:
        if self.runs_plain is not None:
            return f"ooo_wrap check: OK: {self.runs_plain}"
        parts = self._parts()
        if all(part.not_checked is not None for _, part in parts):
            reasons = dict.fromkeys(str(part.not_checked) for _, part in parts)
            return f"ooo_wrap check: NOT CHECKED: {'; '.join(reasons)}"
        verdict = "OK" if self.ok else "FAILED"
        several = f"{plural(len(self.arms), 'arm')}, " if self.by_arm else ""
        lines = [
            f"ooo_wrap check: {verdict} ({several}{plural(self.steps, 'step')}"
            f"{' each' if several else ''}"
            f"{', the last one under simulated graph capture' if self.captured else ''}"
            f"{', forward joins deferred' if self.overlap_forward else ''}; "
            f"{_counts(self)})"
        ]
        lines += [f"  arm {name}: {_verdict(part)}" for name, part in parts if name is not None]
        lines += [f"  note: {note}" for note in self.notes]
        shown = f" (arm {self.shown_arm})" if self.by_arm else ""
        if self.ops:
            lines.append(f"  ops per stream{shown}   forward  backward  step")
            for row in self.ops:
                lines.append(f"    {row.stream:<13}{row.forward:>8}{row.backward:>10}{row.step:>6}")
        if self.plan_estimate is not None:
            lines.append(f"  {self.plan_estimate}{shown} (as model.tuning and plan show it)")
        if self.trace:
            timeline = self.timeline_estimate
            if self.plan_estimate is None:
                lines.append(f"  {timeline} (the recorded step's ops laid out)")
            else:
                lines.append(
                    f"    (the timeline of save_timeline and save_trace lays out the ops the "
                    f"CPU recorded instead, the backward as the engine ran it: "
                    f"{timeline.wrapped_us:.1f} µs vs {timeline.one_stream_us:.1f} µs, "
                    f"{timeline.speedup:.2f}x)"
                )
        for name, part in parts:
            lines += _findings(part, f" [arm {name}]" if self.by_arm else "")
        return "\n".join(lines)

    @property
    def estimate(self) -> StepEstimate:
        """The one estimate of the checked arm (:attr:`shown_arm`): :attr:`plan_estimate`,
        the figure ``model.tuning`` and ``plan`` show, where the plan was learned from a
        forward; else :attr:`timeline_estimate`."""
        return self.plan_estimate if self.plan_estimate is not None else self.timeline_estimate

    @property
    def timeline_estimate(self) -> StepEstimate:
        """The last step's recorded ops laid out on the wrapped streams and on one stream,
        as :meth:`save_timeline` draws them (the backward as the engine ran it on the CPU,
        not modelled from the forward)."""
        steps = split_steps(self.trace)
        last = steps[-1] if steps else []
        wrapped = lay_out(last, gpu=self.gpu, graphed=self.graphed)
        serial = lay_out(last, one_stream=True, gpu=self.gpu, graphed=self.graphed)
        name = wrapped.gpu.name
        return StepEstimate(
            wrapped.length_us, serial.length_us, name, graphed=self.graphed, split=self.split
        )

    def raise_if_failed(self) -> None:
        """Raise :class:`CheckFailed` (an ``OOOError``) with this report unless :attr:`ok`."""
        if not self.ok:
            raise CheckFailed(str(self))

    def save_trace(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome trace JSON for Perfetto or ``chrome://tracing``.

        One track per virtual stream. Time is estimated, not measured: each op lasts its
        estimated device time on the reference GPU named in the process name, laid out as
        ``ooo_wrap.testing._timeline`` describes (host launches in order, each stream in
        order, every wait honoured). Waits are flow arrows from the op waited for to the
        first op after the wait; each race is an arrow between its two accesses plus a
        marker on the later one; each allocator hazard a marker on its access. Each
        training step is an async slice (``ph`` ``b``/``e``, category ``training_step``,
        the learning step named so) with an instant event where it starts. Each op's
        args carry its stage (also for ops of a branch the plan kept on the caller's
        stream), stream, phase and number.
        """
        timeline = lay_out(self.trace, gpu=self.gpu, graphed=self.graphed)
        events = trace_events(timeline, self._shown())  # the findings of the arm shown
        with open(path, "w", encoding="utf-8") as file:
            json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, file)

    def save_timeline(self, path: str | os.PathLike[str]) -> None:
        """Draw the estimated timeline of every step checked, as SVG or PNG.

        One lane per virtual stream; each op a box coloured by phase (forward, backward,
        optimizer step; hover an SVG box for its op, stage and times); each wait an
        arrow from the op waited for to the op after the wait; a dashed line where each
        step starts, and the step that ran inline while the plan was learned shaded.
        Laid out as :meth:`save_trace` lays it out; the title names the reference GPU
        and says it is an estimate, never a measurement.

        Args:
            path: ``*.svg`` writes a self-contained SVG (no dependency); ``*.png`` draws
                with matplotlib (the ``plot`` extra: ``pip install 'ooo-wrap[plot]'``).

        Raises:
            OOOConfigError: ``path`` ends in neither ``.svg`` nor ``.png``.
            OOOError: a ``.png`` without matplotlib installed (the message names the
                extra), or a report with nothing checked (no ops to draw).

        Example::

            >>> report = ooo_wrap.testing.check(model, x)
            >>> report.save_timeline("timeline.svg")   # open in a browser
        """
        if not self.trace:
            raise OOOError(
                "save_timeline(): this report has no ops to draw "
                f"({self.not_checked or 'nothing was recorded'})"
            )
        timeline = lay_out(self.trace, gpu=self.gpu, graphed=self.graphed)
        subtitle = str(self.timeline_estimate)
        save_picture(timeline, path, learning_step=self.learning_step, subtitle=subtitle)


def _counts(report: CheckReport) -> str:
    return (
        f"{plural(len(report.races), 'race')}, "
        f"{plural(len(report.allocator_hazards), 'allocator hazard')}, "
        f"{plural(sum(not p.exact for p in report.parity), 'parity mismatch', 'es')}"
    )


def _verdict(report: CheckReport) -> str:
    """One arm's verdict, on one line."""
    if report.not_checked is not None:
        return f"NOT CHECKED: {report.not_checked}"
    return f"{'OK' if report.ok else 'FAILED'} ({_counts(report)})"


def _findings(report: CheckReport, arm: str) -> list[str]:
    """One line per finding of one arm's ``report`` (``arm``: its tag, or empty)."""
    lines = [f"  race{arm}: {race}" for race in report.races]
    lines += [f"  allocator hazard{arm}: {hazard}" for hazard in report.allocator_hazards]
    if any(_escaped(hazard) for hazard in report.allocator_hazards):
        lines.append(
            "  hint: code outside the stages used a tensor a stage made on its side "
            "stream that did not come back as the stage's return value (stored in "
            "another module's attribute, a global, a container the stage filled?): "
            "the hooks record_stream only what a stage returns and tensors in its "
            "own attributes; return it from the stage's forward()"
        )
    lines += [
        f"  parity{arm}: {entry.name} differs by {entry.max_abs_diff:g}"
        for entry in report.parity
        if not entry.exact
    ]
    return lines


def trace_events(timeline: Timeline, report: CheckReport) -> list[dict[str, object]]:
    """The Chrome trace events of ``timeline``, with ``report``'s findings marked on it."""
    process = f"ooo_wrap check: estimated µs on {timeline.gpu.name}"
    events: list[dict[str, object]] = [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": process}}
    ]
    for index, name in sorted({(s.record.stream_index, s.record.stream) for s in timeline.slots}):
        events.append(
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": index, "args": {"name": name}}
        )
    # Each training step as an async slice (its own track in Perfetto; "X" events stay
    # one per op) and an instant event where it starts.
    for step in step_spans(timeline, report.learning_step):
        name = f"step {step.index}" + (" (learning: ran inline)" if step.learning else "")
        common = {"cat": "training_step", "pid": 1, "tid": 0, "id": f"step{step.index}"}
        args = {"step": step.index, "learning": step.learning}
        events.append({"ph": "b", "name": name, "ts": step.start, "args": args, **common})
        events.append({"ph": "e", "name": name, "ts": step.end, **common})
        events.append(
            {
                "ph": "i",
                "s": "g",
                "name": f"step {step.index} starts",
                "cat": "training_step",
                "pid": 1,
                "tid": 0,
                "ts": step.start,
            }
        )
    by_seq = {slot.record.seq: slot for slot in timeline.slots}
    for slot in timeline.slots:
        record = slot.record
        events.append(
            {
                "ph": "X",
                "name": record.op.removeprefix("aten."),
                "cat": record.phase,
                "pid": 1,
                "tid": record.stream_index,
                "ts": slot.start,
                "dur": slot.end - slot.start,
                "args": {
                    "stage": record.stage or "",
                    "stream": record.stream,
                    "phase": record.phase,
                    "seq": record.seq,
                },
            }
        )
    arrows = [("wait", source, target) for source, target in timeline.waits]
    arrows += [("race", r.earlier.seq, r.later.seq) for r in report.races]
    for flow_id, (cat, source, target) in enumerate(arrows, start=1):
        if source in by_seq and target in by_seq:
            events.append(_flow("s", cat, flow_id, by_seq[source]))
            events.append(_flow("f", cat, flow_id, by_seq[target]))
    marks = [(f"race: {r.kind}", str(r), r.later.seq) for r in report.races]
    marks += [("allocator hazard", str(h), h.access.seq) for h in report.allocator_hazards]
    for name, detail, seq in marks:
        if seq in by_seq:
            slot = by_seq[seq]
            events.append(
                {
                    "ph": "i",
                    "s": "t",
                    "name": name,
                    "cat": "finding",
                    "pid": 1,
                    "tid": slot.record.stream_index,
                    "ts": slot.start,
                    "args": {"detail": detail},
                }
            )
    return events


def _flow(phase: str, cat: str, flow_id: int, slot: Slot) -> dict[str, object]:
    """One end of a flow arrow, inside ``slot`` so Perfetto binds it to that op."""
    event: dict[str, object] = {
        "ph": phase,
        "id": flow_id,
        "name": cat,
        "cat": cat,
        "pid": 1,
        "tid": slot.record.stream_index,
        "ts": (slot.start + slot.end) / 2,
    }
    if phase == "f":
        event["bp"] = "e"
    return event


def count_ops(records: Sequence[OpRecord]) -> tuple[StreamOps, ...]:
    """Ops per stream per phase, streams in id order."""
    counts = Counter((r.stream_index, r.stream, r.phase) for r in records)
    streams = sorted({(index, name) for index, name, _ in counts})
    return tuple(
        StreamOps(
            name,
            counts[(index, name, "forward")],
            counts[(index, name, "backward")],
            counts[(index, name, "step")],
        )
        for index, name in streams
    )


def _escaped(hazard: AllocatorHazard) -> bool:
    """Whether ``hazard`` is a forward use, outside any stage, of a tensor a stage's side
    stream allocated: what reaches the caller without passing the stage's post-hook."""
    access = hazard.access
    return (
        access.phase == "forward"
        and access.stage is None
        and hazard.allocated_on != access.stream
        and hazard.allocated_on != "default"
    )
