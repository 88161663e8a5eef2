"""What measured tuning decides from step times, and how ``model.tuning`` reports it.

Pure statistics on counted step times (``tune.py`` times them). Steps are compared
within an input shape: each counted step is divided by the median plain step of its
shape, so a loop over several sequence lengths compares arms without assuming how the
step grows with the input (attention grows quadratically). With one shape that is the
plain comparison of step times.

An arm beats plain only if its median relative step is below plain's by more than the
noise (``MIN_GAIN`` and either arm's interquartile range over its median); plain wins
when the arm is slower by as much; in between more rounds run, up to ``MAX_ROUNDS``
times the steps, then plain wins. Anything unmeasured keeps plain.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .._events import EventKind, OOOEvent
from .._runtime.backend import Mark
from .._tensors import tensors_in
from .arms import Arm

__all__ = [
    "MAX_ROUNDS",
    "MIN_GAIN",
    "ArmTiming",
    "Shape",
    "TimedStep",
    "Tuning",
    "Verdict",
    "compare",
    "fastest",
    "figures",
    "kept_event",
    "shape_of",
    "slower_why",
    "timing_of",
]

# The smallest gain worth side streams: below it, run-to-run noise on a busy host and the
# risk of a worse step on another batch outweigh it.
MIN_GAIN = 0.02
# How many times tune_steps rounds may run while the evidence is unclear.
MAX_ROUNDS = 3

Verdict = Literal["pending", "faster", "not_faster"]
Shape = tuple[tuple[torch.Size, torch.dtype], ...]
Stage = Literal["racing", "confirming", "decided"]


@dataclass(frozen=True)
class ArmTiming:
    """One arm's measurements.

    Attributes:
        name: the arm (``"plain"``, ``"regions"``, ``"wgrad"``, ...).
        step_ms: its counted step times in milliseconds, in order (every shape).
        relative: each counted step over plain's median step at the same input shape
            (what arms are compared on); empty until plain has a step at that shape.
        estimate_us: the simulator's estimate of its step in µs on the reference GPU
            ``estimate_gpu`` (an estimate, not a measurement), or ``None``.
    """

    name: str
    step_ms: tuple[float, ...] = ()
    relative: tuple[float, ...] = ()
    estimate_us: float | None = None
    estimate_gpu: str | None = None

    @property
    def median_ms(self) -> float | None:
        """The median counted step, or ``None`` before one was counted."""
        return statistics.median(self.step_ms) if self.step_ms else None

    @property
    def median_relative(self) -> float | None:
        """The median step relative to plain at the same shape (plain: about 1)."""
        return statistics.median(self.relative) if self.relative else None

    @property
    def spread(self) -> float | None:
        """The interquartile range of the relative steps over their median."""
        return _spread(self.relative) if len(self.relative) >= 2 else None


@dataclass(frozen=True)
class Tuning:
    """What measured tuning found for one wrapped model (``model.tuning``).

    Attributes:
        decision: ``"pending"`` while measuring, else the name of the arm kept
            (``"plain"``: the model runs as if unwrapped).
        arms: every arm raced, plain first, with its step times.
        confirmation: the final round of the best arm against plain, each with only its
            own hooks (empty if no arm reached it).
        device: the name of the device the steps were timed on.
        shapes: how many input shapes the counted steps had (arms were compared within
            each shape).
        stage: ``"racing"``, ``"confirming"`` or ``"decided"``.
        why: why the decision was made (empty while pending).
        as_graph: whether the steps timed were replays of each arm's CUDA graph of the
            whole step (``graphed_step`` races so), not eager steps.
    """

    decision: str
    arms: tuple[ArmTiming, ...]
    device: str
    confirmation: tuple[ArmTiming, ...] = ()
    shapes: int = 0
    stage: Stage = "racing"
    why: str = field(default="")
    as_graph: bool = False

    def arm(self, name: str) -> ArmTiming | None:
        """The racing record of the arm ``name``, or ``None``."""
        return next((arm for arm in self.arms if arm.name == name), None)

    @property
    def speedup(self) -> float | None:
        """Plain's median step over the best arm's (above 1: that arm is faster): from the
        confirmation round if one ran, else from the race; ``None`` if nothing compared."""
        if len(self.confirmation) == 2:
            plain, best = (arm.median_relative for arm in self.confirmation)
        else:
            raced = [arm.median_relative for arm in self.arms[1:] if arm.median_relative]
            plain, best = (
                self.arms[0].median_relative if self.arms else None,
                min(raced, default=None),
            )
        return plain / best if plain and best else None

    @property
    def compared(self) -> str:
        """How steps were compared."""
        if self.as_graph:
            return "replays of each arm's CUDA graph of the whole step"
        if self.shapes <= 1:
            return "step times at one input shape"
        return f"each step against plain's median at its input shape ({self.shapes} shapes)"

    def __str__(self) -> str:
        head = f"tuning on {self.device}: "
        if self.decision == "pending":
            head += f"pending ({self.stage})"
        else:
            head += f"{self.decision} kept" + (f": {self.why}" if self.why else "")
        rows = [("arm", "steps", "median ms", "vs plain", "spread", "simulator's estimate")]
        for arm in self.arms:
            kept = " *" if arm.name == self.decision else ""
            rows.append(
                (
                    arm.name + kept,
                    str(len(arm.step_ms)),
                    _fmt(arm.median_ms, ".3f"),
                    _fmt(arm.median_relative, ".3f"),
                    _fmt(arm.spread, ".1%"),
                    "-"
                    if arm.estimate_us is None
                    else f"{arm.estimate_us:.0f} µs on {arm.estimate_gpu}",
                )
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [head, f"compared: {self.compared}"]
        for row in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if self.confirmation:
            confirmed = ", ".join(
                f"{arm.name} {_fmt(arm.median_relative, '.3f')} ({len(arm.relative)} steps)"
                for arm in self.confirmation
            )
            lines.append(f"confirmation round (each arm alone): {confirmed}")
        return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def compare(arm: Sequence[float], plain: Sequence[float], steps: int, *, final: bool) -> Verdict:
    """Whether the arm's relative steps beat plain's; ``final`` when no more may run."""
    if not final and min(len(arm), len(plain)) < steps:
        return "pending"
    if len(arm) < 2 or len(plain) < 2:
        return "not_faster"  # unmeasured: plain stands
    mine, theirs = statistics.median(arm), statistics.median(plain)
    margin = max(MIN_GAIN, _spread(arm), _spread(plain))
    if mine < theirs * (1 - margin):
        return "faster"
    if final or mine > theirs * (1 + margin):
        return "not_faster"
    return "pending"


def _spread(times: Sequence[float]) -> float:
    """Interquartile range over the median."""
    quartiles = statistics.quantiles(times, n=4)
    return (quartiles[2] - quartiles[0]) / quartiles[1] if quartiles[1] > 0 else float("inf")


def figures(record: Tuning) -> str:
    """The figures behind ``record``'s decision: medians, speedup, steps, device."""
    if len(record.confirmation) == 2:
        plain, best = record.confirmation
        where = "in the confirmation round"
    else:
        raced = [arm for arm in record.arms[1:] if arm.median_relative is not None]
        if not raced or record.arms[0].median_ms is None:
            return f"no arm could be timed against plain on {record.device}"
        plain, best = record.arms[0], min(raced, key=lambda arm: arm.median_relative or 0.0)
        where = "in the race"
    if best.median_ms is None or plain.median_ms is None or record.speedup is None:
        return f"{where}, no step could be timed against plain on {record.device}"
    steps = "graph replays" if record.as_graph else "steps"
    return (
        f"{where}, median step {best.median_ms:.3f} ms with {best.name} vs "
        f"{plain.median_ms:.3f} ms plain ({record.speedup:.2f}x, {len(best.step_ms)} and "
        f"{len(plain.step_ms)} {steps} measured on {record.device})"
    )


def slower_why(record: Tuning) -> str:
    """Why a ``measured_slower`` model runs plain: the figures."""
    return f"{figures(record)}: {record.why}"


def kept_event(record: Tuning) -> OOOEvent:
    """The ``TUNED`` event of a decided ``record`` that keeps an arm other than plain."""
    return OOOEvent(
        EventKind.TUNED, "kept", f"{figures(record)}: {record.decision} is kept ({record.why})"
    )


def fastest(faster: Sequence[Arm], timings: Mapping[str, ArmTiming]) -> Arm:
    """The fastest arm; among those within the noise of it, the simplest."""

    def median(arm: Arm) -> float:
        value = timings[arm.name].median_relative
        return value if value is not None else float("inf")

    best = min(median(arm) for arm in faster)
    spread = max((timings[arm.name].spread or 0.0) for arm in faster)
    close = [arm for arm in faster if median(arm) <= best * (1 + max(spread, MIN_GAIN))]
    return min(close, key=Arm.simplicity)


@dataclass
class TimedStep:
    """One step being timed: its marks, and whether it counts (``arm`` is ``None`` if not)."""

    arm: Arm | None
    shape: Shape
    stage: Stage
    marks: list[Mark]  # start, then pairs cutting out evaluation forwards, then the end
    ms: float | None = None  # the time once read


def shape_of(args: Any, kwargs: Any) -> Shape:
    """The shapes and dtypes of a forward's tensors: the steps of one input shape are
    compared with each other."""
    return tuple((t.shape, t.dtype) for t in tensors_in(args) + tensors_in(kwargs))


def timing_of(arm: Arm, steps: Sequence[TimedStep]) -> ArmTiming:
    """``arm``'s counted steps, each also relative to plain's median at its shape."""
    timed = [s for s in steps if s.ms is not None]
    plain_at: dict[Shape, list[float]] = {}
    for step in timed:
        if step.arm is not None and step.arm.is_plain:
            plain_at.setdefault(step.shape, []).append(step.ms)  # type: ignore[arg-type]
    medians = {shape: statistics.median(ms) for shape, ms in plain_at.items()}
    mine = [s for s in timed if s.arm is arm]
    relative = tuple(
        s.ms / medians[s.shape]  # type: ignore[operator]
        for s in mine
        if s.shape in medians and medians[s.shape] > 0
    )
    return ArmTiming(
        arm.name,
        tuple(s.ms for s in mine),  # type: ignore[misc]
        relative,
        arm.estimate_us,
        arm.estimate_gpu,
    )
