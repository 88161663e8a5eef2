"""A picture of the checker's estimated timeline: SVG (no dependency) or PNG (matplotlib).

Reads only a :class:`~ooo_wrap.testing._timeline.Timeline`'s slots (each op's record,
start and end), its waits, its length and its reference GPU, so it draws whatever
layout produced them. One lane per stream, caller's stream on top; each op a box
coloured by its phase (forward, backward, optimizer step); each wait an arrow from the
end of the op waited for to the start of the op that waited; a dashed line where each
training step starts, and the step that ran inline while the plan was learned shaded.
Every figure is an estimate on the named reference GPU, and the title says so.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import OOOConfigError, OOOError
from ._timeline import Slot, Timeline

__all__ = ["PHASE_COLOURS", "StepSpan", "save_picture", "step_spans", "svg_text"]

PHASE_COLOURS = {"forward": "#4c78a8", "backward": "#f58518", "step": "#54a24b"}
PHASE_NAMES = {"forward": "forward", "backward": "backward", "step": "optimizer step"}
_EXTRA = "plot"  # pyproject.toml's optional extra that installs matplotlib

# SVG geometry, in px.
_LEFT, _RIGHT, _TOP, _LANE, _GAP, _WIDTH = 110, 20, 70, 28, 10, 1200


@dataclass(frozen=True)
class StepSpan:
    """One training step on the time axis: from its first op's start to its last op's end.

    ``learning``: the step ran inline while the plan was learned.
    """

    index: int
    start: float
    end: float
    learning: bool


def step_spans(timeline: Timeline, learning_step: int | None = None) -> list[StepSpan]:
    """The steps of ``timeline``: a step starts at a forward op after another phase."""
    groups: list[list[Slot]] = []
    previous = None
    for slot in timeline.slots:
        if not groups or (slot.record.phase == "forward" and previous != "forward"):
            groups.append([])
        groups[-1].append(slot)
        previous = slot.record.phase
    return [
        StepSpan(
            index,
            min(s.start for s in group),
            max(s.end for s in group),
            index == learning_step,
        )
        for index, group in enumerate(groups, start=1)
    ]


def _lanes(timeline: Timeline) -> list[tuple[int, str]]:
    return sorted({(s.record.stream_index, s.record.stream) for s in timeline.slots})


def _title(timeline: Timeline, subtitle: str) -> str:
    title = f"ooo_wrap check: estimated step timeline on {timeline.gpu.name}"
    return f"{title} (an estimate, not a measurement){'; ' + subtitle if subtitle else ''}"


def _label(slot: Slot) -> str:
    record = slot.record
    stage = f" [{record.stage}]" if record.stage else ""
    return (
        f"{record.op.removeprefix('aten.')}{stage} on {record.stream}, "
        f"{PHASE_NAMES.get(record.phase, record.phase)}: {slot.start:.1f}-{slot.end:.1f} µs "
        f"(estimated), #{record.seq}"
    )


def svg_text(timeline: Timeline, *, learning_step: int | None = None, subtitle: str = "") -> str:
    """The timeline as a self-contained SVG document (see the module docstring)."""
    lanes = _lanes(timeline)
    row = {index: i for i, (index, _) in enumerate(lanes)}
    length = max(timeline.length_us, 1e-9)
    height = _TOP + len(lanes) * (_LANE + _GAP) + 60
    width = _LEFT + _WIDTH + _RIGHT

    def x(t: float) -> float:
        return _LEFT + t / length * _WIDTH

    def y(stream_index: int) -> float:
        return _TOP + row[stream_index] * (_LANE + _GAP)

    esc = html.escape
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" '
        'markerWidth="6" markerHeight="6" orient="auto-start-reverse">'
        '<path d="M 0 0 L 10 5 L 0 10 z" fill="#333"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text class="title" x="{_LEFT}" y="22" font-size="14" font-weight="bold">'
        f"{esc(_title(timeline, subtitle))}</text>",
    ]
    steps = step_spans(timeline, learning_step)
    bottom = _TOP + len(lanes) * (_LANE + _GAP)
    for step in steps:
        label = f"step {step.index}" + (" (learning: ran inline)" if step.learning else "")
        if step.learning:
            out.append(
                f'<rect class="learning-step" x="{x(step.start):.2f}" y="{_TOP - 8}" '
                f'width="{max(x(step.end) - x(step.start), 0.5):.2f}" '
                f'height="{bottom - _TOP + 8}" fill="#eeeeee"><title>{esc(label)}</title></rect>'
            )
        out.append(
            f'<line class="step-boundary" x1="{x(step.start):.2f}" y1="{_TOP - 14}" '
            f'x2="{x(step.start):.2f}" y2="{bottom}" stroke="#666" stroke-dasharray="4 3"/>'
        )
        out.append(
            f'<text class="step-label" x="{x(step.start) + 3:.2f}" y="{_TOP - 16}">'
            f"{esc(label)}</text>"
        )
    for index, name in lanes:
        top = y(index)
        out.append(
            f'<rect class="lane" x="{_LEFT}" y="{top}" width="{_WIDTH}" height="{_LANE}" '
            'fill="none" stroke="#ccc"/>'
        )
        out.append(
            f'<text class="lane-label" x="{_LEFT - 8}" y="{top + _LANE / 2 + 4}" '
            f'text-anchor="end">{esc(name)}</text>'
        )
    for slot in timeline.slots:
        record = slot.record
        left, right = x(slot.start), x(slot.end)
        colour = PHASE_COLOURS.get(record.phase, "#999")
        out.append(
            f'<rect class="op {esc(record.phase)}" x="{left:.2f}" '
            f'y="{y(record.stream_index) + 3}" width="{max(right - left, 0.5):.2f}" '
            f'height="{_LANE - 6}" fill="{colour}" stroke="white" stroke-width="0.3">'
            f"<title>{esc(_label(slot))}</title></rect>"
        )
    by_seq = {slot.record.seq: slot for slot in timeline.slots}
    for source, target in timeline.waits:
        if source in by_seq and target in by_seq:
            a, b = by_seq[source], by_seq[target]
            out.append(
                f'<line class="wait" x1="{x(a.end):.2f}" '
                f'y1="{y(a.record.stream_index) + _LANE / 2}" x2="{x(b.start):.2f}" '
                f'y2="{y(b.record.stream_index) + _LANE / 2}" stroke="#333" '
                'stroke-width="0.8" marker-end="url(#arrow)">'
                f"<title>wait: #{source} before #{target}</title></line>"
            )
    legend_y = bottom + 30
    cursor = _LEFT
    for phase, colour in PHASE_COLOURS.items():
        out.append(
            f'<rect class="legend" x="{cursor}" y="{legend_y - 10}" width="12" height="12" '
            f'fill="{colour}"/><text x="{cursor + 16}" y="{legend_y}">{PHASE_NAMES[phase]}</text>'
        )
        cursor += 130
    out.append(
        f'<text x="{cursor}" y="{legend_y}">arrow: a stream waits for another; dashed: a '
        f"step starts; axis 0-{timeline.length_us:.1f} µs (estimated)</text>"
    )
    out.append("</svg>")
    return "\n".join(out) + "\n"


def save_picture(
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    learning_step: int | None = None,
    subtitle: str = "",
) -> None:
    """Draw ``timeline`` to ``path``: SVG for ``.svg``, PNG (matplotlib) for ``.png``.

    Raises:
        OOOConfigError: another suffix.
        OOOError: ``.png`` without matplotlib (the message names the extra to install).
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".svg":
        text = svg_text(timeline, learning_step=learning_step, subtitle=subtitle)
        Path(path).write_text(text, encoding="utf-8")
    elif suffix == ".png":
        _png(timeline, path, learning_step, subtitle)
    else:
        raise OOOConfigError(
            f"save_timeline({os.fspath(path)!r}): the suffix picks the format: .svg (no "
            "dependency) or .png (needs matplotlib)"
        )


def _png(
    timeline: Timeline, path: str | os.PathLike[str], learning_step: int | None, subtitle: str
) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise OOOError(
            f"save_timeline({os.fspath(path)!r}) draws a PNG with matplotlib, which is not "
            f"installed: pip install 'ooo-wrap[{_EXTRA}]' (or matplotlib), or save as .svg, "
            "which needs nothing"
        ) from None
    lanes = _lanes(timeline)
    row = {index: i for i, (index, _) in enumerate(lanes)}
    figure = Figure(figsize=(14, 1.2 + 0.5 * len(lanes)))
    FigureCanvasAgg(figure)
    axes: Any = figure.add_subplot()
    for slot in timeline.slots:
        record = slot.record
        axes.barh(
            row[record.stream_index],
            max(slot.end - slot.start, timeline.length_us * 1e-4),
            left=slot.start,
            height=0.7,
            color=PHASE_COLOURS.get(record.phase, "#999"),
            edgecolor="white",
            linewidth=0.2,
        )
    by_seq = {slot.record.seq: slot for slot in timeline.slots}
    for source, target in timeline.waits:
        if source in by_seq and target in by_seq:
            a, b = by_seq[source], by_seq[target]
            axes.annotate(
                "",
                xy=(b.start, row[b.record.stream_index]),
                xytext=(a.end, row[a.record.stream_index]),
                arrowprops={"arrowstyle": "->", "lw": 0.6, "color": "#333"},
            )
    for step in step_spans(timeline, learning_step):
        if step.learning:
            axes.axvspan(step.start, step.end, color="#eeeeee", zorder=0)
        axes.axvline(step.start, color="#666", linestyle="--", linewidth=0.8)
        label = f"step {step.index}" + (" (learning: inline)" if step.learning else "")
        axes.text(step.start, len(lanes) - 0.4, f" {label}", fontsize=8, va="bottom")
    axes.set_yticks(range(len(lanes)), [name for _, name in lanes])
    axes.set_ylim(len(lanes) - 0.3, -0.7)
    axes.set_xlim(0, max(timeline.length_us, 1e-9))
    axes.set_xlabel("estimated µs")
    axes.set_title(_wrap(_title(timeline, subtitle)), fontsize=9)
    handles: Sequence[Patch] = [
        Patch(color=colour, label=PHASE_NAMES[phase]) for phase, colour in PHASE_COLOURS.items()
    ]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=120)


def _wrap(text: str, width: int = 140) -> str:
    """``text`` in lines of at most about ``width`` characters, split at ``; ``."""
    lines: list[str] = []
    for part in text.split("; "):
        if lines and len(lines[-1]) + len(part) + 2 <= width:
            lines[-1] += "; " + part
        else:
            lines.append(part)
    return "\n".join(lines)
