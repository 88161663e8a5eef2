"""The events the scheduler reports, built off the hot path.

Each function makes one :class:`OOOEvent`; the scheduler decides when (once per stage, or
per stage and type) and adds it to the model's log.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .._events import EventKind, OOOEvent
from .._reasons import MESSAGES
from .inflight import StageRuntime

__all__ = [
    "bypassed",
    "interrupted",
    "kept_in_attribute",
    "not_called",
    "stage_failed",
    "untracked",
]


def not_called(
    root: nn.Module, stage: StageRuntime, stage_name_of: Callable[[object], str | None]
) -> OOOEvent:
    """A forward finished without calling ``stage``: its hooks never ran, so it never ran
    on its stream (a grouping module forward does not call, a branch this forward did not
    take, or a stage replaced after wrapping)."""
    return _surgery(root, stage, stage_name_of) or OOOEvent(
        EventKind.STAGE_NOT_CALLED,
        "not_called",
        "a forward of the model finished without calling this stage, so it did "
        "not run on its side stream; if forward never calls it as a module (it "
        "only groups others), name the sub-modules forward calls with "
        "stages=[...]",
        stage=stage.name,
    )


def _surgery(
    root: nn.Module, stage: StageRuntime, stage_name_of: Callable[[object], str | None]
) -> OOOEvent | None:
    """The event for a stage that is no longer the module at its name (model surgery
    after wrapping: ``model.blocks[1] = new``, ``del model.blocks[2]``), else ``None``.

    Looked up only here, off the hot path: the hooks stay on the module wrapped as the
    stage, so whatever now sits at the name runs as forward calls it, hook-free.
    """
    try:
        current: nn.Module | None = root.get_submodule(stage.name)
    except AttributeError:
        current = None
    wrapped = stage.module() if stage.module is not None else None
    if current is not None and current is wrapped:
        return None
    fix = (
        "model.replan() (dataflow planner) or ooo_wrap.unwrap(model) and wrapping it "
        "again plans with the model as it is now"
    )
    if current is None:
        return OOOEvent(
            EventKind.STAGE_REPLACED,
            "removed",
            f"the model has no sub-module {stage.name!r} any more (removed after "
            f"wrapping), so this stage no longer runs; {fix}",
            stage=stage.name,
        )
    other = stage_name_of(current)
    now = (
        f"the module now there runs as stage {other!r}, on that stage's side stream"
        if other is not None
        else "the module now there is not a stage: it runs inline on the caller's "
        "stream, as a plain sub-module"
    )
    return OOOEvent(
        EventKind.STAGE_REPLACED,
        "replaced",
        f"sub-module {stage.name!r} was replaced after wrapping; {now}; {fix}",
        stage=stage.name,
    )


def untracked(stage: StageRuntime, type_name: str) -> OOOEvent:
    """An input or output of ``stage`` holds a ``type_name`` the hooks could not search."""
    return OOOEvent(
        EventKind.UNTRACKED,
        type_name,
        f"an input or output of this stage holds a {type_name} the hooks cannot "
        "search for tensors (no attributes, or an object inside an object): "
        "tensors in it get no record_stream, an allocator hazard on a GPU. "
        "Pass tensors in tuples, lists, dicts, dataclasses, objects' own "
        "attributes, or types registered with torch.utils._pytree",
        stage=stage.name,
    )


def kept_in_attribute(stage: StageRuntime, name: str) -> OOOEvent:
    """``stage`` holds a tensor in its plain attribute ``name`` (not a parameter or buffer)."""
    return OOOEvent(
        EventKind.UNTRACKED,
        "attribute",
        f"this stage holds a tensor in self.{name}, maybe a result stored instead of "
        "returned: the hooks record_stream the tensors in the stage's own plain "
        "attributes for the caller's stream after each call, but not tensors it stores "
        "anywhere else (a parent's attribute, a global, a container), which are an "
        "allocator hazard on a GPU. Return results from forward(), and register "
        "constants as buffers",
        stage=stage.name,
    )


def stage_failed(stage: StageRuntime, error: BaseException) -> OOOEvent:
    """``stage`` raised ``error``; its post-hook restored the caller's stream."""
    name = type(error).__name__
    return OOOEvent(
        EventKind.STAGE_FAILED,
        name,
        f"stage raised {name}; the caller's stream was restored "
        "and the exception propagated unchanged",
        stage=stage.name,
    )


def interrupted() -> OOOEvent:
    """A forward was interrupted inside a stage; the stale-call recovery undid it."""
    return OOOEvent(
        EventKind.STAGE_FAILED,
        "interrupted",
        "an earlier forward was interrupted inside a stage (e.g. KeyboardInterrupt); "
        "the caller's stream was restored when the model was next called, "
        "replanned or unwrapped",
    )


def bypassed(reason: str, count: int = 1) -> OOOEvent:
    """Stage calls ran inline on the caller's stream for ``reason`` (``bypass.py``)."""
    return OOOEvent(EventKind.BYPASSED, reason, MESSAGES[reason], count=count)
