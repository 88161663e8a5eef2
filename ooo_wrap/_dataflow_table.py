"""How a :class:`~ooo_wrap._dataflow.LearnedPlan` prints: regions, stages, edges, estimates."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._plan import plural

if TYPE_CHECKING:
    from ._dataflow import LearnedPlan

__all__ = ["format_chain", "render"]


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


def render(learned: LearnedPlan) -> str:
    """Several lines: outcome, estimates (labelled), regions with their stages, edges."""
    streams = len({stage.stream for stage in learned.stages})
    lines = [
        f"Learned plan ({learned.outcome}): {plural(len(learned.stages), 'stage')} in "
        f"{plural(len(learned.regions), 'region')} on {plural(streams, 'side stream')} "
        f"(max {learned.max_streams})"
    ]
    if learned.outcome == "no_parallelism":
        lines.append(f"  nothing to overlap; longest chain: {format_chain(learned.longest_chain)}")
    if learned.estimate is not None:
        lines.append(f"  {learned.estimate}")
        lines.append(
            f"    (simulated: host launches and fork/joins ({learned.fork_join_us:.1f} µs per "
            "forward), backward from the forward, kernels sharing the GPU by occupancy)"
        )
    else:
        lines.append(
            f"  estimate on {learned.gpu}: forward {learned.forward_us:.1f} µs on one stream"
        )
    for rejected in learned.rejected:
        lines.append(f"  rejected: {rejected} (an estimate on {learned.gpu})")
    stage_us = {stage.name: stage for stage in learned.stages}
    for region in learned.regions:
        lines.append(f"  region {region.name or '<root>'} (width {region.width})")
        rows: list[tuple[str, ...]] = [("branch", "call", "stream", "est. µs", "stage calls")]
        for index, branch in enumerate(region.branches):
            for name, us in zip(branch.calls, branch.call_us, strict=True):
                stage = stage_us.get(name)
                if stage is not None:
                    rows.append(
                        (str(index), name, str(stage.stream), f"{us:.1f}", str(stage.calls))
                    )
                    continue
                inner = any(s.startswith(name + ".") for s in stage_us) if name else bool(stage_us)
                where = "split" if inner and branch.stream is not None else "caller"
                rows.append((str(index), f"({name})", where, f"{us:.1f}", "-"))
        lines += _table(rows)
    if learned.outcome == "named":
        named: list[tuple[str, ...]] = [("stage", "stream", "est. µs", "calls")]
        named += [
            (s.name, str(s.stream), f"{s.device_us:.1f}", str(s.calls)) for s in learned.stages
        ]
        lines += _table(named)
    pairs = Counter(
        (e.producer, e.consumer, e.producer_stream, e.consumer_stream) for e in learned.edges
    )
    if pairs:
        lines.append("  dataflow edges between stages (per forward):")
        for (producer, consumer, a, b), count in pairs.items():
            times = f" x{count}" if count > 1 else ""
            lines.append(f"    {producer} [{a}] -> {consumer} [{b}]{times}")
    lines += [f"  note: {note}" for note in learned.notes]
    return "\n".join(lines)
