"""Copies and pickles of a wrapped model: the plain model, wrapped again with the same options.

A wrapped model's hooks close over its scheduler (per-thread state, streams), which is
neither copyable nor picklable, and its class ``OOO<Cls>`` is made at run time, so pickle
cannot import it by name. So the scheduler is never copied:

- ``copy.deepcopy(wrapped)`` deep-copies the model as its original class with the wrapper's
  hooks left out, then wraps the copy with the same options and the same backend object.
  The copy has its own hooks, streams, events and stats.
- ``pickle`` / ``torch.save`` store the plain model (original class, the wrapper's hooks
  left out, nothing on the original changed) and the options; loading wraps it again, on
  the devices it is loaded to, or falls back (and ``events_for`` says why).
- ``copy.copy(wrapped)`` raises: a shallow copy would share the stages, and so the hooks.
- A stage copied or pickled apart from its model raises (``Scheduler.__reduce_ex__``); so
  does a pickle that reaches a stage other than as a sub-module (say, from a plain list
  attribute), since only the module tree is stored without the hooks.

User hooks are copied and pickled like any other module state. The wrapper's hooks are
registered again after them, so on the copy a user hook added to a stage after wrapping
runs before the wrapper's rather than after: the protocol orders the streams either way.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from typing import Any, NoReturn

from torch import nn
from torch.utils.hooks import RemovableHandle

from ._errors import OOOError
from ._events import EventKind, OOOEvent
from ._options import WrapOptions
from ._wrap import _wrap, _wrapped, _WrapState

__all__ = ["deepcopy_wrapped", "reduce_wrapped", "refuse_shallow_copy"]

# Where a deep copy meets one of the wrapper's hooks, it puts this instead of copying the
# hook (and its scheduler); those entries are then removed from the copy.
_LEFT_OUT = object()


def deepcopy_wrapped(model: nn.Module, state: _WrapState, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy`` of a wrapped model: a plain deep copy, wrapped with the same options."""
    for handle in state.handles:
        # The hook callables only: the extra dicts' values are ``True``, which must copy as is.
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            memo[id(hooks[handle.id])] = _LEFT_OUT
    cls = state.original_class
    clone = cls.__new__(cls)
    memo[id(model)] = clone  # before copying the state: it may refer back to the model
    # nn.Module's __getstate__ / __setstate__ are untyped in torch.
    plain_state = model.__getstate__()  # type: ignore[no-untyped-call]
    clone.__setstate__(copy.deepcopy(plain_state, memo))  # type: ignore[no-untyped-call]
    for hooks, hook_id in _hook_entries(state.handles):
        copied = memo.get(id(hooks))  # the copy of this hook dict, made just above
        if isinstance(copied, dict):
            copied.pop(hook_id, None)
    _wrap_again(
        clone,
        state.options,
        "deepcopy",
        "a deep copy of a wrapped model, wrapped again with the same options: its own "
        "hooks, streams, events and stats (the original's stay with the original)",
    )
    return clone


def reduce_wrapped(model: nn.Module, state: _WrapState) -> tuple[Any, ...]:
    """``__reduce_ex__`` of a wrapped model: rebuild the plain model, then wrap it again."""
    plain_state = model.__getstate__()  # type: ignore[no-untyped-call]  # untyped in torch
    if not isinstance(plain_state, dict):
        raise OOOError(
            f"cannot pickle this wrapped {state.original_class.__name__}: its __getstate__ "
            "does not return a dict; save model.state_dict(), or ooo_wrap.unwrap(model) first"
        )
    ours: dict[int, set[int]] = {}  # id of a hook dict -> ids of the wrapper's hooks in it
    for hooks, hook_id in _hook_entries(state.handles):
        ours.setdefault(id(hooks), set()).add(hook_id)
    on_paths = set()  # every module below the root on the way down to a stage, stage included
    for stage in state.plan.stages:
        parts = stage.name.split(".")
        for depth in range(1, len(parts) + 1):
            on_paths.add(id(model.get_submodule(".".join(parts[:depth]))))
    views: dict[int, nn.Module] = {}
    payload = (_plain_copy_of(plain_state, ours, on_paths, views), state.options)
    # The 6th item (state_setter) runs after the state is loaded: the model is rebuilt
    # first, so references back to it inside its own state resolve to the new object.
    return (_new_instance, (state.original_class,), payload, None, None, _restore)


def refuse_shallow_copy(model: nn.Module) -> NoReturn:
    """``copy.copy`` of a wrapped model: refused, it would share the original's hooks."""
    raise OOOError(
        f"copy.copy of a wrapped {type(model).__name__} would share its stages, and so its "
        "hooks, with the original; use copy.deepcopy(model), or ooo_wrap.unwrap(model) first"
    )


def _hook_entries(handles: list[RemovableHandle]) -> Iterator[tuple[dict[Any, Any], int]]:
    """Each (hook dict, hook id) the wrapper's handles own, extra dicts included."""
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            hooks = ref()
            if hooks is not None and handle.id in hooks:
                yield hooks, handle.id


def _plain_copy_of(
    module_state: dict[str, Any],
    ours: dict[int, set[int]],
    on_paths: set[int],
    views: dict[int, nn.Module],
) -> dict[str, Any]:
    """A shallow copy of a module's state without the wrapper's hooks, children on a path
    to a stage replaced by such copies too; tensors and other values are shared."""
    plain: dict[str, Any] = {}
    for key, value in module_state.items():
        dropped = ours.get(id(value))
        if dropped is not None:
            value = type(value)((k, v) for k, v in value.items() if k not in dropped)
        plain[key] = value
    children = plain.get("_modules")
    if isinstance(children, dict):
        plain["_modules"] = type(children)(
            (name, _plain_view(child, ours, on_paths, views) if id(child) in on_paths else child)
            for name, child in children.items()
        )
    return plain


def _plain_view(
    module: nn.Module, ours: dict[int, set[int]], on_paths: set[int], views: dict[int, nn.Module]
) -> nn.Module:
    """A new object of ``module``'s class sharing its tensors, without the wrapper's hooks.

    Only ever pickled, never run; one per module, so a module registered twice stays one.
    """
    view = views.get(id(module))
    if view is None:
        cls = type(module)
        view = views[id(module)] = cls.__new__(cls)
        view.__dict__.update(_plain_copy_of(vars(module), ours, on_paths, views))
    return view


def _new_instance(cls: type[nn.Module]) -> nn.Module:
    """An empty instance of the original class; its state is set by :func:`_restore`."""
    return cls.__new__(cls)


def _restore(model: nn.Module, payload: tuple[dict[str, Any], WrapOptions]) -> None:
    """Load the plain state into ``model`` and wrap it again (or let it fall back)."""
    plain_state, options = payload
    model.__setstate__(plain_state)  # type: ignore[no-untyped-call]  # untyped in torch
    _wrap_again(
        model,
        options,
        "unpickled",
        "loaded from a pickle of a wrapped model and wrapped again with the same options",
    )


def _wrap_again(model: nn.Module, options: WrapOptions, reason: str, message: str) -> None:
    """Wrap ``model`` as ``options`` say; when it is wrapped, note where it came from."""
    _wrap(model, options)
    state = _wrapped.get(model)
    if state is not None:
        state.log.add(OOOEvent(EventKind.ENABLED, reason, message), level=logging.DEBUG)
