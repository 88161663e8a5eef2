"""Where the scheme cannot help: the checks that leave a model untouched, and their events.

Run before anything is installed. The device comes first, so a model that cannot use side
streams anyway falls back whatever its layout, without planning it; then the layout (two
or more stages, on one device).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from .._errors import OOOConfigError, warn_user
from .._events import EventKind, OOOEvent
from .._plan import Plan
from .._planner.api import named_stages, plan
from .._reasons import MESSAGES, Reason
from .._runtime.backend import Backend, clock_of
from .learn import pending_plan
from .lifecycle import devices
from .options import WrapOptions
from .registry import detached, wrapped
from .split import split_wanted

__all__ = ["UNTOUCHED", "record_fallback", "refuse_nested", "what_to_install"]

logger = logging.getLogger("ooo_wrap")

# The end of the message of every model returned untouched: nothing of the wrapper is on it,
# so model.events raises AttributeError, and the event has to say where it can be read.
UNTOUCHED = (
    "; returned untouched (no model.events, model.plan, model.stats or model.tuning on it): "
    "read its events with ooo_wrap.events_for(model)"
)

# A stage's device is that of its parameters or buffers: without any, there is no device to
# put side streams on or to time steps on, whatever the stage names say.
_NO_TENSORS = (
    "the model has neither parameters nor buffers: no stage to find (stages are sub-modules "
    "with parameters or buffers) and no device to run side streams on, standard backward"
)


def what_to_install(
    model: nn.Module, options: WrapOptions, backend: Backend
) -> tuple[Plan, torch.device | None] | None:
    """The plan to install and the device to learn it on (``None`` for a static plan), or
    ``None`` if the model falls back (its event recorded)."""
    if not devices(model):
        record_fallback(model, Reason.TOO_FEW_STAGES, message=_NO_TENSORS)
        return None
    reasons = [backend.unsupported_reason(device) for device in devices(model)]
    if all(reason is not None for reason in reasons):
        _device_fallback(model, str(reasons[0]), options)
        return None
    if options.tune is True and clock_of(backend, devices(model)[0]) is None:
        raise OOOConfigError(
            f"tune=True measures steps on the device, but the {backend.name} backend cannot "
            "time them; pass tune='auto' (tunes where it can) or tune=False, or give "
            "SimulatedBackend a step_time= clock"
        )
    if options.planner == "dataflow":
        # Named stages are checked now (the same errors as the static plan); automatic
        # stages are not known yet, so only a model with no supported device falls back.
        named = named_stages(model, options.streams, options.stages)
        if named is not None and len(named.stages) < 2:
            _too_few_stages(model, named)
            return None
        usable = [d for d in devices(model) if backend.unsupported_reason(d) is None]
        return pending_plan(options.streams), usable[0]
    the_plan = plan(model, options.streams, stages=options.stages)
    if len(the_plan.stages) < 2 and split_wanted(model, options, backend):
        return dataclasses.replace(the_plan, stages=()), None  # the split is the plan
    if len(the_plan.stages) < 2:
        _too_few_stages(model, the_plan)
        return None
    if len(the_plan.devices) > 1:
        record_fallback(model, Reason.MULTI_DEVICE)
        return None
    reason = backend.unsupported_reason(the_plan.devices[0])
    if reason is not None:
        _device_fallback(model, reason, options)
        return None
    return the_plan, None


def record_fallback(
    model: nn.Module, reason: str, *, warn: bool = False, message: str | None = None
) -> nn.Module:
    """Leave ``model`` untouched, record a ``DISABLED`` event for it and return it; the
    event's message is ``message``, or the reason's usual one, then where to read it."""
    event = OOOEvent(EventKind.DISABLED, reason, (message or MESSAGES[reason]) + UNTOUCHED)
    detached[model] = (event,)
    logger.info("%s", event)
    if warn:
        warn_user(f"ooo_wrap: {event.message}")
    return model


def _too_few_stages(model: nn.Module, the_plan: Plan) -> None:
    """Fall back for fewer than two stages; where the user named the one stage, the usual
    hint (name stages) would be wrong: say why one is not enough."""
    if the_plan.source not in ("argument", "attribute") or len(the_plan.stages) != 1:
        record_fallback(model, Reason.TOO_FEW_STAGES)
        return
    name = the_plan.stages[0].name
    if the_plan.source == "argument":
        where, fix = "stages=", f"stages=[{name!r}, ...]"
    else:
        where, fix = "model.ooo_stage_names", f"ooo_stage_names = [{name!r}, ...]"
    record_fallback(
        model,
        Reason.TOO_FEW_STAGES,
        message=f"{where} names a single stage, {name!r}, which has nothing to overlap "
        "with (stages overlap each other, so it takes two or more): standard backward; "
        f"name two or more sub-modules that can run at the same time ({fix}), or leave "
        "the names out to have the stages found",
    )


def _device_fallback(model: nn.Module, reason: str, options: WrapOptions) -> None:
    """Fall back for the device; warn about the natural mistake of wrapping on the CPU and
    moving the model to the accelerator afterwards. Every time: Python's warnings registry
    shows it once per calling line under the default filter, and the user's filters rule."""
    record_fallback(model, reason)
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if reason != Reason.CPU or options.backend is not None or accelerator is None:
        return
    warn_user(
        f"ooo_wrap: the model is on the CPU but a {accelerator.type} accelerator is "
        "available, so OOOModule left it untouched (moving it afterwards does not wrap "
        f"it); move it first, then wrap: OOOModule(model.to({accelerator.type!r}), ...)"
    )


def refuse_nested(model: nn.Module) -> None:
    """One wrapped model may not contain another: both would fork the same calls."""
    for name, sub in model.named_modules(remove_duplicate=False):
        if sub is not model and sub in wrapped:
            raise OOOConfigError(
                f"sub-module '{name}' of this {type(model).__name__} is already wrapped; "
                "wrap only one of them: ooo_wrap.unwrap() the inner one first, or keep it "
                "and name its parts as stages there"
            )
    for other in list(wrapped):
        for name, sub in other.named_modules(remove_duplicate=False):
            if sub is model:
                raise OOOConfigError(
                    f"this {type(model).__name__} is sub-module '{name}' of a wrapped "
                    f"{type(other).__name__}; wrap only one of them (name '{name}' or its "
                    "parts as stages of the outer model instead)"
                )
