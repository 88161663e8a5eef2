"""A model's candidate arms once its plan is known, ordered by the simulator's estimate.

The estimate is on a reference GPU from one observed forward (``_planner/simulate.py``),
never a measurement: it only orders the candidates; the device decides among them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import nn

from .._plan import Plan
from .._planner.api import reference_gpu
from .._planner.cost import ReferenceGPU
from .._planner.learned_plan import learned_of
from .._planner.placement import named_chain
from .._planner.simulate import estimate_arm
from .._planner.static import static_plan
from .._runtime.wgrad import split_layers
from .arms import Arm, candidates, plain_arm, raced
from .options import WrapOptions

__all__ = ["ArmEstimate", "arm_estimate", "candidates_for", "forms_chain", "plain_for"]

# (stages, split) -> (estimated step in µs, reference GPU), or None where not estimated.
ArmEstimate = Callable[[Plan, bool], "tuple[float, str] | None"]


def arm_estimate(learned: Plan, gpu: ReferenceGPU) -> ArmEstimate:
    """Estimates from the forward ``learned`` (a dataflow plan) was learned from, priced
    as it was learned (eager launches, or a CUDA graph replay); none for a plan with no
    observed forward (the static planner's)."""
    found = learned_of(learned)
    record = None if found is None else found.record
    graphed = found is not None and found.estimate is not None and found.estimate.graphed

    def estimate(plan: Plan, split: bool) -> tuple[float, str] | None:
        if record is None:
            return None
        streams = {stage.name: stage.stream for stage in plan.stages}
        ids = {call.call_id: streams[call.name] for call in record.calls() if call.name in streams}
        if not ids and not split:  # plain: the one-stream step
            return estimate_arm(record, {}, gpu, graphed=graphed).one_stream_us, gpu.name
        return estimate_arm(record, ids, gpu, split=split, graphed=graphed).wrapped_us, gpu.name

    return estimate


def forms_chain(learned: Plan, stages: Plan) -> bool:
    """Whether ``stages`` form one chain in the forward ``learned`` was learned from (each
    stage reads what the one before wrote): then no two stages run at once, forward or
    backward, on any GPU, and such a plan can only add forks and joins to plain."""
    found = learned_of(learned)
    if found is None or found.record is None:
        return False
    return bool(named_chain(found.record, [stage.name for stage in stages.stages]))


def candidates_for(
    model: nn.Module, the_plan: Plan, failure: str | None, options: WrapOptions
) -> tuple[Arm, ...]:
    """The candidates besides plain for ``the_plan`` (learned, or the static planner's):
    those raced (at most ``tune_arms``), or every one where an arm is pinned."""
    plans = [("static" if failure or options.planner == "static" else "regions", the_plan)]
    if plans[0][0] == "regions":
        static = static_plan(model, options.streams, options.stages)
        if not forms_chain(the_plan, static):  # a chain of stages can never be faster
            plans.append(("static", static))
    found = candidates(
        plans,
        split=options.split_weight_grads,
        can_split=bool(split_layers(model, options.split_weight_grads_exclude)),
        overlap=options.overlap_forward,
        estimate=arm_estimate(the_plan, reference_gpu(options.gpu)),
    )
    return found if options.tune_arm is not None else raced(found, options.tune_arms)


def plain_for(the_plan: Plan, options: WrapOptions) -> Arm:
    """The plain arm, with the simulator's one-stream estimate where there is one."""
    plain = plain_arm(the_plan)
    figure = arm_estimate(the_plan, reference_gpu(options.gpu))(plain.plan, False)
    if figure is None:
        return plain
    return dataclasses.replace(plain, estimate_us=figure[0], estimate_gpu=figure[1])
