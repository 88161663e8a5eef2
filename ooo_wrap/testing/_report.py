"""``CheckReport``: what ``check()`` found, readable, raisable and exportable as a trace."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import OOOError
from .._plan import plural
from ._tracker import AllocatorHazard, OpRecord, Race

__all__ = ["CheckFailed", "CheckReport", "ParityEntry", "StreamOps", "count_ops"]


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
        not_checked: why nothing was checked, when the wrapper fell back (the model then
            ran with standard backward, so there were no side streams to check); ``None``
            when the wrapped model was checked.

    Example::

        >>> report = ooo_wrap.testing.check(model, x)
        >>> print(report)
        >>> report.raise_if_failed()
        >>> report.save_trace("trace.json")   # open in https://ui.perfetto.dev
    """

    races: tuple[Race, ...]
    allocator_hazards: tuple[AllocatorHazard, ...]
    parity: tuple[ParityEntry, ...]
    ops: tuple[StreamOps, ...]
    trace: tuple[OpRecord, ...]
    notes: tuple[str, ...]
    steps: int
    not_checked: str | None = None

    @property
    def ok(self) -> bool:
        """Something was checked, with no race, no allocator hazard, and bitwise parity
        with the plain run."""
        return (
            self.not_checked is None
            and not self.races
            and not self.allocator_hazards
            and all(entry.exact for entry in self.parity)
        )

    def __str__(self) -> str:
        if self.not_checked is not None:
            return f"ooo_wrap check: NOT CHECKED: {self.not_checked}"
        verdict = "OK" if self.ok else "FAILED"
        lines = [
            f"ooo_wrap check: {verdict} ({plural(self.steps, 'step')}; "
            f"{plural(len(self.races), 'race')}, "
            f"{plural(len(self.allocator_hazards), 'allocator hazard')}, "
            f"{plural(sum(not p.exact for p in self.parity), 'parity mismatch', 'es')})"
        ]
        lines += [f"  note: {note}" for note in self.notes]
        if self.ops:
            lines.append("  ops per stream   forward  backward  step")
            for row in self.ops:
                lines.append(f"    {row.stream:<13}{row.forward:>8}{row.backward:>10}{row.step:>6}")
        for race in self.races:
            lines.append(f"  race: {race}")
        for hazard in self.allocator_hazards:
            lines.append(f"  allocator hazard: {hazard}")
        for entry in self.parity:
            if not entry.exact:
                lines.append(f"  parity: {entry.name} differs by {entry.max_abs_diff:g}")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        """Raise :class:`CheckFailed` (an ``OOOError``) with this report unless :attr:`ok`."""
        if not self.ok:
            raise CheckFailed(str(self))

    def save_trace(self, path: str | os.PathLike[str]) -> None:
        """Write a Chrome trace JSON: one track per virtual stream, ops in order.

        Each op is a 1 µs slice at its position in the run (time is simulated), named by
        its op and carrying its stage and phase; Perfetto and ``chrome://tracing`` open it.
        """
        events: list[dict[str, object]] = [
            {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "ooo_wrap"}}
        ]
        for index, name in sorted({(r.stream_index, r.stream) for r in self.trace}):
            events.append(
                {"ph": "M", "name": "thread_name", "pid": 1, "tid": index, "args": {"name": name}}
            )
        for record in self.trace:
            events.append(
                {
                    "ph": "X",
                    "name": record.op.removeprefix("aten."),
                    "cat": record.phase,
                    "pid": 1,
                    "tid": record.stream_index,
                    "ts": record.seq,
                    "dur": 1,
                    "args": {"stage": record.stage or "", "phase": record.phase},
                }
            )
        with open(path, "w", encoding="utf-8") as file:
            json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, file)


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
