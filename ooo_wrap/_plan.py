"""The contract between planning and running: which sub-modules are stages, on which stream.

A :class:`Plan` is plain frozen data. The planner (``ooo_wrap._planner``) makes one; the
runtime and the wrapper only read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from ._errors import OOOConfigError, positive_int

__all__ = [
    "LearnedDetails",
    "Plan",
    "Stage",
    "StageSource",
    "StepEstimate",
    "as_stage_names",
    "check_streams",
    "plural",
]

StageSource = Literal["argument", "attribute", "automatic", "dataflow"]


@dataclass(frozen=True)
class StepEstimate:
    """A step's estimated length with its streams and with the same ops on one stream.

    An estimate from a cost model (roofline per op, launch and fork/join costs on the
    host, concurrent kernels sharing the GPU by occupancy) on the reference GPU named in
    ``gpu``, never a measurement. The same type for a learned plan and for the checker.

    Attributes:
        wrapped_us: the step with the plan's streams (and the split, with ``split``).
        one_stream_us: the plain model's step: every op on one stream.
        gpu: the reference GPU's name.
        graphed: priced as a CUDA graph replay (no per-kernel launch on the host, event
            forks and joins as graph edges), both steps; else as eager launches.
        split: the plan's step has the weight-gradient split in force.
    """

    wrapped_us: float
    one_stream_us: float
    gpu: str
    graphed: bool = False
    split: bool = False

    @property
    def speedup(self) -> float:
        """One-stream length over wrapped length (above 1: the streams would help)."""
        return self.one_stream_us / self.wrapped_us if self.wrapped_us > 0 else 1.0

    @property
    def pricing(self) -> str:
        """How the step was priced, in words."""
        return "priced as a CUDA graph replay" if self.graphed else "priced as eager launches"

    def __str__(self) -> str:
        split = " with the weight-gradient split" if self.split else ""
        return (
            f"estimated step: {self.wrapped_us:.1f} µs on these streams{split} vs "
            f"{self.one_stream_us:.1f} µs on one stream ({self.speedup:.2f}x), "
            f"{self.pricing}; an estimate on {self.gpu}, not a measurement"
        )


class LearnedDetails(Protocol):
    """What a plan carries of the dataflow planner's work (its ``LearnedPlan``): the step
    estimate, and ``str()`` for the learned table."""

    @property
    def estimate(self) -> StepEstimate | None: ...


@dataclass(frozen=True)
class Stage:
    """One disjoint sub-module run on a side stream.

    Attributes:
        name: dotted name of the sub-module in the model (as in ``named_modules()``).
        stream: index of the side stream it runs on, ``0 <= stream < Plan.num_streams``;
            the plan table and the race checker's report call it ``side<stream + 1>``.
        device: the device of its first parameter or buffer (else the model's).
        num_params: number of parameter elements in the stage, for display; parameters
            of a lazy module not yet run (``nn.LazyLinear``) are not counted.
    """

    name: str
    stream: int
    device: torch.device
    num_params: int

    @property
    def stream_name(self) -> str:
        """``side1`` for stream 0, ...: the name the race checker's report gives it."""
        return f"side{self.stream + 1}"


@dataclass(frozen=True)
class Plan:
    """Which sub-modules become stages and which side stream each one runs on.

    Attributes:
        stages: the stages in model order.
        max_streams: the ``streams`` asked for.
        source: where the stage names came from: the ``stages=`` argument, the model's
            ``ooo_stage_names`` attribute, automatic expansion, or the model's dataflow.
        learned: the plan learned from one observed forward (regions, estimates, edges)
            when the ``dataflow`` planner made this plan, else ``None``. A ``dataflow``
            plan without it and without stages is one still to be learned.
    """

    stages: tuple[Stage, ...]
    max_streams: int
    source: StageSource
    learned: LearnedDetails | None = field(default=None, compare=False, repr=False)

    @property
    def num_streams(self) -> int:
        """Side streams actually used: one past the highest stream index of a stage."""
        return max((stage.stream for stage in self.stages), default=-1) + 1

    @property
    def estimate(self) -> StepEstimate | None:
        """The learned plan's simulated step against one stream (the type
        ``CheckReport.estimate`` has); ``None`` for a plan never estimated."""
        return None if self.learned is None else self.learned.estimate

    @property
    def pending(self) -> bool:
        """A ``dataflow`` plan not learned yet (it is learned on the first training forward)."""
        return self.source == "dataflow" and self.learned is None and not self.stages

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The distinct devices of the stages, in stage order."""
        return tuple(dict.fromkeys(stage.device for stage in self.stages))

    def __str__(self) -> str:
        if self.pending:
            return (
                f"Plan: to be learned from the model's dataflow on its first training forward "
                f"(which runs inline on the caller's stream; max {self.max_streams} side "
                "streams); print it again after that forward"
            )
        header = (
            f"Plan: {plural(len(self.stages), 'stage')} on "
            f"{plural(self.num_streams, 'side stream')} "
            f"(max {self.max_streams}; stages from {self.source})"
        )
        rows = [("stage", "stream", "device", "params")]
        rows += [(s.name, s.stream_name, str(s.device), f"{s.num_params:,}") for s in self.stages]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [header]
        for row in rows if self.stages else []:
            cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1])]
            cells += [row[2].ljust(widths[2]), row[3].rjust(widths[3])]
            lines.append("  " + "  ".join(cells).rstrip())
        if self.learned is not None:
            lines.append(str(self.learned))
        return "\n".join(lines)


def plural(count: int, noun: str, suffix: str = "s") -> str:
    """``"1 stage"``, ``"2 stages"``; ``suffix="es"`` for ``"2 mismatches"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{suffix}"


def check_streams(streams: object, where: str = "streams") -> int:
    """Return ``streams`` if it is a positive int, else raise :class:`OOOConfigError`."""
    return positive_int(streams, where, " (the most side streams to use, e.g. 4)")


def as_stage_names(value: object, where: str) -> list[str]:
    """Check that ``value`` is a sequence of strings (and not one bare string)."""
    if isinstance(value, str):
        raise OOOConfigError(
            f"{where} must be a sequence of dotted names, got the string {value!r}; "
            f"did you mean [{value!r}]?"
        )
    if not isinstance(value, Sequence) or not all(isinstance(n, str) for n in value):
        raise OOOConfigError(
            f"{where} must be a sequence of dotted module names, got {value!r}; "
            "pass e.g. ['encoder', 'decoder']"
        )
    return list(value)
