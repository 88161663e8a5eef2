"""When a wrap installs the weight-gradient split, and installing it with a plan.

``split_weight_grads=True`` puts the split in every planned forward; ``"auto"`` only where
measured tuning races the plan against plain (so it is kept only if the plan is kept), or
where an arm is pinned (``tune_arm=``: the split arms are candidates then too); ``False``
never. A model with no layer to split never has it. The split's layers are
swapped with the scheduler's hooks and restored with them (``lifecycle.py``).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from .._events import EventKind, OOOEvent
from .._plan import Plan, plural
from .._runtime.backend import Backend, clock_of
from .._runtime.wgrad import split_layers
from .options import WrapOptions

__all__ = [
    "devices",
    "plan_device",
    "split_alone",
    "split_event",
    "split_wanted",
]


def devices(model: nn.Module) -> list[torch.device]:
    """The distinct devices of the model's parameters and buffers, in model order."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return list(dict.fromkeys(tensor.device for tensor in tensors))


def plan_device(model: nn.Module, the_plan: Plan) -> torch.device:
    """The device a plan runs on: its stages', or the model's for the split alone."""
    return the_plan.devices[0] if the_plan.stages else devices(model)[0]


def split_wanted(
    model: nn.Module, options: WrapOptions, backend: Backend, device: torch.device | None = None
) -> bool:
    """Whether a plan on ``device`` (default: the model's) runs with the split (see the
    module docstring)."""
    wanted = options.split_weight_grads
    if wanted is False or not split_layers(model, options.split_weight_grads_exclude):
        return False
    device = devices(model)[0] if device is None else device
    if wanted is True or options.tune_arm is not None:  # a pinned arm may be a split arm
        return True
    return options.tune is not False and clock_of(backend, device) is not None


def split_alone(
    model: nn.Module, the_plan: Plan, failure: str | None, options: WrapOptions, backend: Backend
) -> Plan | None:
    """For a learned plan with nothing for stages to overlap (too few stages, or stages on
    several devices): the split alone as its plan, where the split is wanted; else ``None``."""
    too_few = not the_plan.stages or (failure is not None and len(the_plan.stages) < 2)
    if not (too_few or len(the_plan.devices) > 1):
        return None
    if not split_wanted(model, options, backend):
        return None
    return dataclasses.replace(the_plan, stages=())


def split_event(the_plan: Plan, layers: int) -> OOOEvent:
    """The event of a plan that runs with the split on ``layers`` layers."""
    alone = "" if the_plan.stages else "the plan is the split alone (no parallel branches); "
    return OOOEvent(
        EventKind.PLANNED,
        "weight_grads",
        f"{alone}{plural(layers, 'layer')} compute their weight gradients on a "
        "weight-gradient stream, off the input-gradient chain",
    )
