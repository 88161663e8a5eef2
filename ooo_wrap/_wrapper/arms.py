"""The candidate plans measured tuning races, each a complete way to run the model.

An :class:`Arm` is a plan's stages (run on side streams) and whether the weight-gradient
split is in force; ``plain`` (no stage, no split: the model as if unwrapped) is always an
arm. The names are short and stable, so a run can be reproduced by pinning one
(``OOOModule(..., tune_arm="wgrad")``):

- ``regions``: the stages the dataflow planner learned (every region its rule finds);
- ``static``: the stage rule (stage names, or automatic expansion, streams round-robin);
- ``wgrad``: the weight-gradient split alone, no stage;
- ``regions+wgrad``, ``static+wgrad``: both;
- a ``+overlap`` suffix on stage arms where the user asked for deferred forward joins
  (``overlap_forward=True``): that mode has races no check can see (a C++ extension
  reading a pending tensor), so it is never turned on unasked.

Which candidates exist follows the options: ``split_weight_grads=True`` puts the split in
every arm but plain, ``"auto"`` adds split arms beside the others, ``False`` none.

Ordering. The simulator's estimate orders candidates (an estimate on a reference GPU,
never a measurement); the device decides. A candidate is dropped before measurement only
where it cannot be faster than another arm on any GPU: it runs exactly the same streams
and layers as an arm already listed (a duplicate: the static rule naming the learned
stages), or the same as plain (no stage and no split layer). Of the rest, at most
``tune_arms`` are raced: first the best-estimated candidate of each kind (stages, the
split, both), then the others by estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from .._plan import Plan

__all__ = ["Arm", "ArmKind", "candidates", "plain_arm", "raced"]

ArmKind = Literal["plain", "stages", "split", "both"]
# Simpler first: on a tie the simpler arm is kept (fewer hooks, fewer streams).
_KIND_ORDER: tuple[ArmKind, ...] = ("plain", "split", "stages", "both")


@dataclass(frozen=True)
class Arm:
    """One way to run the model: ``plan``'s stages on side streams, with or without the
    weight-gradient split; ``estimate_us``: the simulator's step estimate on the reference
    GPU ``estimate_gpu`` (``None`` where there is none)."""

    name: str
    plan: Plan
    split: bool
    overlap: bool = False
    estimate_us: float | None = None
    estimate_gpu: str | None = None

    @property
    def kind(self) -> ArmKind:
        if self.plan.stages:
            return "both" if self.split else "stages"
        return "split" if self.split else "plain"

    @property
    def is_plain(self) -> bool:
        return self.kind == "plain"

    def same_as(self, other: Arm) -> bool:
        """Whether both run the same stages on the same streams, with the same split."""
        return (self.split, self.overlap, _layout(self.plan)) == (
            other.split,
            other.overlap,
            _layout(other.plan),
        )

    def simplicity(self) -> tuple[int, int, str]:
        """Sort key: simpler arms first (kind, then fewer stages, then the name)."""
        return (_KIND_ORDER.index(self.kind), len(self.plan.stages), self.name)


def _layout(plan: Plan) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((stage.name, stage.stream) for stage in plan.stages))


def plain_arm(plan: Plan) -> Arm:
    """The plain model: no stage, no split."""
    return Arm("plain", dataclasses.replace(plan, stages=()), split=False)


def candidates(
    stage_plans: Sequence[tuple[str, Plan]],
    *,
    split: bool | Literal["auto"],
    can_split: bool,
    overlap: bool,
    estimate: Callable[[Plan, bool], tuple[float, str] | None] | None = None,
) -> tuple[Arm, ...]:
    """Every candidate besides plain, ordered by estimate, duplicates dropped.

    Args:
        stage_plans: ``(name, plan)`` of each stage plan (``regions``, ``static``), in
            order of preference; plans with no stage (``static``: fewer than two) are
            skipped.
        split: the ``split_weight_grads`` option (``"auto"``: only with tuning, which the
            caller decides by passing ``can_split``).
        can_split: whether the model has a layer to split and the split may run.
        overlap: the ``overlap_forward`` option: stage arms run with deferred joins.
        estimate: ``(plan, split) -> (µs, reference GPU)`` or ``None`` (no estimate).
    """
    with_split = can_split and split is not False
    without_split = split is not True or not can_split
    suffix = "+overlap" if overlap else ""
    found: list[Arm] = []
    for name, plan in stage_plans:
        # A learned plan may keep one branch on a side stream (the heaviest stays on the
        # caller's); the stage rule needs two stages to overlap anything.
        if len(plan.stages) < (1 if name == "regions" else 2):
            continue
        if without_split:
            found.append(Arm(f"{name}{suffix}", plan, split=False, overlap=overlap))
        if with_split:
            found.append(Arm(f"{name}+wgrad{suffix}", plan, split=True, overlap=overlap))
    if with_split and stage_plans:
        found.append(Arm("wgrad", dataclasses.replace(stage_plans[0][1], stages=()), split=True))
    unique: list[Arm] = []
    for arm in found:
        if not any(arm.same_as(kept) for kept in unique):
            unique.append(_estimated(arm, estimate))
    return tuple(sorted(unique, key=_by_estimate))


def _estimated(arm: Arm, estimate: Callable[[Plan, bool], tuple[float, str] | None] | None) -> Arm:
    figure = None if estimate is None else estimate(arm.plan, arm.split)
    if figure is None:
        return arm
    return dataclasses.replace(arm, estimate_us=figure[0], estimate_gpu=figure[1])


def _by_estimate(arm: Arm) -> tuple[float, tuple[int, int, str]]:
    # Unestimated candidates after the estimated ones, simpler first among equals.
    us = arm.estimate_us if arm.estimate_us is not None else float("inf")
    return (us, arm.simplicity())


def raced(found: Sequence[Arm], limit: int) -> tuple[Arm, ...]:
    """At most ``limit`` of ``found`` (ordered by estimate): each kind's best first."""
    chosen: list[Arm] = []
    kinds: set[ArmKind] = set()
    for arm in found:
        if arm.kind not in kinds and len(chosen) < limit:
            chosen.append(arm)
            kinds.add(arm.kind)
    for arm in found:
        if arm not in chosen and len(chosen) < limit:
            chosen.append(arm)
    return tuple(sorted(chosen, key=found.index))
