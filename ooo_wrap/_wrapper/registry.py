"""Which models are wrapped (or were, or fell back), and what other layers ask about them.

Keyed weakly by the model: nothing here keeps a model alive, and nothing is stored on it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

from torch import nn

from .._compat import forward_hook_dicts
from .._events import OOOEvent
from .arms import Arm
from .lifecycle import Phase, WrapState
from .tune import Tuner

__all__ = [
    "detached",
    "events_for",
    "graph_race_decided",
    "hold_for_graph",
    "is_wrapped",
    "let_go_of_graph",
    "mark_graphed",
    "plan_pending",
    "price_as_graph_replay",
    "race_as_graph",
    "root_hooks_lifted",
    "runs_plain",
    "stage_of",
    "wrapped",
]

wrapped: weakref.WeakKeyDictionary[nn.Module, WrapState] = weakref.WeakKeyDictionary()
# The events of models that fell back untouched, or were unwrapped.
detached: weakref.WeakKeyDictionary[nn.Module, tuple[OOOEvent, ...]] = weakref.WeakKeyDictionary()


def events_for(model: nn.Module) -> tuple[OOOEvent, ...]:
    """The events of ``model``: wrapped, fallen back untouched, or unwrapped.

    Returns ``()`` for a model :class:`OOOModule` never saw.

    Example::

        >>> model = ooo_wrap.OOOModule(cpu_model)   # falls back: returns cpu_model
        >>> ooo_wrap.events_for(model)[-1].reason
        'cpu'
    """
    state = wrapped.get(model)
    if state is not None:
        return state.events()
    return detached.get(model, ())


def is_wrapped(model: object) -> bool:
    """Whether ``model`` is a model :class:`OOOModule` wrapped (and has not unwrapped)."""
    return isinstance(model, nn.Module) and model in wrapped


def plan_pending(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped and its plan is still to be learned: it carries the
    learner's two root hooks and no stage hook yet."""
    state = wrapped.get(model)
    return state is not None and state.phase is Phase.LEARNING


def runs_plain(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped but carries no hook of the wrapper: learning found
    nothing to overlap, or the learned plan could not start (a ``DISABLED`` event says why)."""
    state = wrapped.get(model)
    return state is not None and state.phase is Phase.STOPPED


def stage_of(module: object) -> tuple[nn.Module, str] | None:
    """The wrapped model and stage name if ``module`` is a stage with the wrapper's hooks.

    By the hooks, not by name: after model surgery (``model.blocks[1] = new``) the module
    wrapped as the stage keeps the hooks, and the one now at the name has none.
    """
    for model, state in list(wrapped.items()):
        if state.scheduler is None:
            continue  # no stage hooks yet (plan to be learned) or none at all
        name = state.scheduler.stage_name_of(module)
        if name is not None:
            return model, name
    return None


@contextlib.contextmanager
def root_hooks_lifted(model: nn.Module) -> Iterator[None]:
    """Take the wrapper's hooks off ``model`` itself for the block; its stages keep theirs.

    Afterwards, even if the block raised, they are put back exactly: the same handles
    (``unwrap`` still removes them) at the same places in the hook order. Hooks that others
    added or removed meanwhile stay as they are then. A no-op on a model not wrapped.
    """
    state = wrapped.get(model)
    if state is None:
        yield
        return
    dicts = forward_hook_dicts(model)
    before = [dict(hooks) for hooks in dicts]
    # Handle ids are unique in the process: a handle whose id is in the root's own dicts
    # holds a root hook (the scheduler's or the learner's pair).
    root = [handle for handle in state.handles if any(handle.id in hooks for hooks in dicts)]
    lifted = {handle.id for handle in root}
    try:
        for handle in root:
            handle.remove()
        yield
    finally:
        for hooks, saved in zip(dicts, before, strict=True):
            kept = [
                (key, saved[key] if key in lifted else hooks[key])
                for key in saved
                if key in lifted or key in hooks
            ]
            added = [(key, hook) for key, hook in hooks.items() if key not in saved]
            hooks.clear()
            hooks.update(kept + added)


def mark_graphed(model: nn.Module) -> None:
    """Tell the scheduler of ``model`` (if any) that its forwards replay a CUDA graph now,
    so forwards that call no stage are expected (see ``Scheduler.stages_replay_in_a_graph``);
    tuning, if underway, stops undecided."""
    state = wrapped.get(model)
    if state is not None:
        state.graphed(model)


def price_as_graph_replay(model: nn.Module) -> bool:
    """Have the plan of ``model``, still to be learned, priced as a CUDA graph replay of its
    step (``learn(..., graphed=True)``); whether it was still to be learned."""
    state = wrapped.get(model)
    learner = None if state is None or state.phase is not Phase.LEARNING else state.learner
    if learner is None:
        return False
    learner.graphed = True
    return True


def hold_for_graph(model: nn.Module) -> None:
    """A forward of ``model`` in a step ``graphed_step`` warms up: a plan still to be
    learned is priced as a graph replay; a tuning model times nothing."""
    state = wrapped.get(model)
    if state is None or price_as_graph_replay(model):
        return  # not wrapped, or its plan is priced as a graph replay when learned
    tuner = state.tuner if state.phase is Phase.TUNING else None
    if tuner is not None and not tuner.held:
        tuner.hold(tuner.active)  # it times nothing: its arms are raced as graphs next


def let_go_of_graph(model: nn.Module) -> None:
    """Undo ``hold_for_graph``: a tuning model times its eager steps again."""
    state = wrapped.get(model)
    if state is not None and state.tuner is not None:
        state.tuner.hold(None)


def race_as_graph(model: nn.Module) -> Tuner | None:
    """The tuner whose arms ``graphed_step`` races as graphs for ``model``, or ``None``
    (not tuning). A decision measured on eager steps, or taken from the cache, is raced
    again: eager step times do not apply to a replay."""
    state = wrapped.get(model)
    if state is None:
        return None
    decided = state.decided
    eager = decided is not None and not decided.as_graph
    if eager and state.phase in (Phase.SCHEDULED, Phase.STOPPED) and len(state.arms) > 1:
        state.retune(model)
    return state.tuner if state.phase is Phase.TUNING else None


def graph_race_decided(model: nn.Module, tuner: Tuner) -> None:
    """``tuner``'s graph race of ``model`` decided: keep the winner's hooks, as eager
    tuning does (a no-op if the model has another tuner now: replanned, or decided by
    another graphed step of it)."""
    state = wrapped.get(model)
    if state is not None and state.tuner is tuner:
        state.apply_decision(model)


def arms_of(model: nn.Module) -> tuple[Arm, ...]:
    """The arms measured tuning races (or races no more) for ``model``: plain and its
    candidates once its plan is known; empty for a model not wrapped or not yet planned."""
    state = wrapped.get(model)
    return () if state is None else state.arms
