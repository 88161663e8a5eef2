"""Copies and pickles of a wrapped model: the plain model, wrapped again with the same options.

A wrapped model's hooks close over its scheduler (per-thread state, streams), which is
neither copyable nor picklable, and its class ``OOO<Cls>`` is made at run time, so pickle
cannot import it by name. So the scheduler is never copied:

- ``copy.deepcopy(wrapped)`` deep-copies the model as its original class with a marker in
  place of each of the wrapper's hooks, then wraps the copy with the same options and the
  same backend object. The copy has its own hooks, streams, events and stats.
- ``pickle`` / ``torch.save`` store the plain model (original class, markers in place of
  the wrapper's hooks, nothing on the original changed) and the options; loading wraps it
  again, on the devices it is loaded to, or falls back (and ``events_for`` says why).
- ``copy.copy(wrapped)`` raises: a shallow copy would share the stages, and so the hooks.
- A stage copied or pickled apart from its model raises (``Scheduler.__reduce_ex__``); so
  does a pickle that reaches a stage other than as a sub-module (say, from a plain list
  attribute), since only the module tree is stored without the hooks.
- After model surgery (a stage replaced, moved or removed) the model is copied as it is
  now: the wrapper's hooks are found by their hook dicts, not by stage name. If the stage
  names it was wrapped with no longer fit it, the copy could not be wrapped again with
  the same options, so copying or pickling raises ``OOOError`` naming the stage, at once
  (rather than when the pickle is loaded).

This module makes the plain copy and puts the new hooks in place; wrapping the copy again
is ``module.py``'s (``_wrap_again``, and ``_restore`` for pickles), which sits above it.

User hooks are copied and pickled like any other module state, and keep their place: the
markers say where the wrapper's hooks were, so that the new hooks take those places (a user
hook added to a stage after wrapping still runs after the wrapper's, on the caller's stream).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .._compat import MODULE_CHILDREN_KEY, handle_dicts, hook_dicts, next_hook_id
from .._errors import OOOConfigError, OOOError
from .._events import EventKind, OOOEvent
from .._planner.api import named_stages
from .lifecycle import WrapState

__all__ = [
    "Marked",
    "new_instance",
    "plain_deepcopy",
    "plain_state",
    "put_in_place",
    "take_markers",
]

Hooks = dict[Any, Any]  # a module's hook dict (an OrderedDict), keyed by hook id
# Each hook dict that held a marker, with its keys in order (markers in the wrapper's places).
Marked = list[tuple[Hooks, list[Any]]]


@dataclass(frozen=True)
class _WrapperHook:
    """Marks, in a copied or pickled hook dict, the place of the wrapper's hook number
    ``index`` (in install order); the new wrapper's hook of that index takes the place.

    Part of the pickle format of wrapped models, with :func:`new_instance`,
    ``ooo_wrap._wrapper.module._restore`` and ``WrapOptions``: renaming them breaks loading
    older pickles.
    """

    index: int


def plain_deepcopy(model: nn.Module, state: WrapState, memo: dict[int, Any]) -> nn.Module:
    """A deep copy of a wrapped model as its original class, markers in place of the
    wrapper's hooks (``copy.deepcopy``; the caller wraps it again)."""
    _check_rewrappable(model, state, "copy")
    handles = state.handles
    for index, handle in enumerate(handles):
        hooks = handle_dicts(handle)[0]
        if hooks is not None and handle.id in hooks:
            memo[id(hooks[handle.id])] = _WrapperHook(index)  # copied as the marker
    cls = state.original_class
    clone = cls.__new__(cls)
    memo[id(model)] = clone  # before copying the state: it may refer back to the model
    # nn.Module's __getstate__ / __setstate__ are untyped in torch.
    module_state = model.__getstate__()  # type: ignore[no-untyped-call]
    clone.__setstate__(copy.deepcopy(module_state, memo))  # type: ignore[no-untyped-call]
    for hooks, hook_id in _extra_entries(handles):
        copied = memo.get(id(hooks))  # the copy of this dict, made just above
        if isinstance(copied, dict):
            copied.pop(hook_id, None)
    return clone


def plain_state(model: nn.Module, state: WrapState) -> dict[str, Any]:
    """The state to pickle for a wrapped model: its own, with markers in place of the
    wrapper's hooks and plain views of the modules on the way down to them; nothing of
    the model itself changes."""
    _check_rewrappable(model, state, "pickle")
    module_state = model.__getstate__()  # type: ignore[no-untyped-call]  # untyped in torch
    if not isinstance(module_state, dict):
        raise OOOError(
            f"cannot pickle this wrapped {state.original_class.__name__}: its __getstate__ "
            "does not return a dict; save model.state_dict(), or ooo_wrap.unwrap(model) first"
        )
    ours: dict[int, dict[int, _WrapperHook | None]] = {}  # id(dict) -> hook id -> marker
    handles = state.handles
    for index, handle in enumerate(handles):
        hooks = handle_dicts(handle)[0]
        if hooks is not None:
            ours.setdefault(id(hooks), {})[handle.id] = _WrapperHook(index)
    for hooks, hook_id in _extra_entries(handles):
        ours.setdefault(id(hooks), {})[hook_id] = None  # membership only: just dropped
    return _plain_copy_of(module_state, ours, _on_paths(model, ours), {})


def _check_rewrappable(model: nn.Module, state: WrapState, verb: str) -> None:
    """Raise ``OOOError`` if the stage names the model was wrapped with no longer fit it
    (surgery after wrapping): its copy could not be wrapped again with the same options."""
    options = state.options
    if options.stages is None and getattr(model, "ooo_stage_names", None) is None:
        return  # automatic stages: planned again for the copy, whatever its layout
    try:
        named_stages(model, options.streams, options.stages)
    except OOOConfigError as error:
        raise OOOError(
            f"cannot {verb} this wrapped {state.original_class.__name__}: the copy is wrapped "
            f"again with the same options, whose stage names no longer fit the model, changed "
            f"after wrapping ({error}). ooo_wrap.unwrap(model) and wrap it again with its "
            "current stage names, or save model.state_dict()"
        ) from None


def _on_paths(model: nn.Module, ours: dict[int, Any]) -> set[int]:
    """Every module below the root on the way down to one that holds a wrapper hook (one of
    ``ours`` dicts), that one included: by the hooks, not by stage name, since surgery after
    wrapping may have moved or removed a stage, or put a plain module at its name."""
    leads: dict[int, bool] = {}

    def visit(module: nn.Module) -> bool:
        key = id(module)
        if key not in leads:
            leads[key] = False  # while visiting: a tree that loops back counts once
            holds = any(id(value) in ours for value in vars(module).values())
            below = [visit(child) for child in module.children()]
            leads[key] = holds or any(below)
        return leads[key]

    visit(model)
    return {key for key, on in leads.items() if on and key != id(model)}


def _extra_entries(handles: list[RemovableHandle]) -> Iterator[tuple[Hooks, int]]:
    """Each (dict, hook id) in the handles' extra dicts (``with_kwargs``, ``always_call``)."""
    for handle in handles:
        for hooks in handle_dicts(handle)[1]:
            if handle.id in hooks:
                yield hooks, handle.id


def _plain_copy_of(
    module_state: dict[str, Any],
    ours: dict[int, dict[int, _WrapperHook | None]],
    on_paths: set[int],
    views: dict[int, nn.Module],
) -> dict[str, Any]:
    """A shallow copy of a module's state with markers for the wrapper's hooks, children on
    a path to a stage replaced by such copies too; tensors and other values are shared."""
    plain: dict[str, Any] = {}
    for key, value in module_state.items():
        markers = ours.get(id(value))
        if markers is not None:
            value = type(value)(
                (k, markers.get(k, v))
                for k, v in value.items()
                if k not in markers or markers[k] is not None
            )
        plain[key] = value
    children = plain.get(MODULE_CHILDREN_KEY)
    if isinstance(children, dict):
        plain[MODULE_CHILDREN_KEY] = type(children)(
            (name, _plain_view(child, ours, on_paths, views) if id(child) in on_paths else child)
            for name, child in children.items()
        )
    return plain


def _plain_view(
    module: nn.Module,
    ours: dict[int, dict[int, _WrapperHook | None]],
    on_paths: set[int],
    views: dict[int, nn.Module],
) -> nn.Module:
    """A new object of ``module``'s class sharing its tensors, with markers for hooks.

    Only ever pickled, never run; one per module, so a module registered twice stays one.
    """
    view = views.get(id(module))
    if view is None:
        cls = type(module)
        view = views[id(module)] = cls.__new__(cls)
        view.__dict__.update(_plain_copy_of(vars(module), ours, on_paths, views))
    return view


def new_instance(cls: type[nn.Module]) -> nn.Module:
    """An empty instance of the original class (a pickle's first step); its state is set
    by ``module._restore``."""
    return cls.__new__(cls)


def take_markers(model: nn.Module) -> Marked:
    """Before wrapping a copy again: give loaded hooks fresh ids, take every marker out and
    return each dict that had one, with its keys in order."""
    _rekey_loaded_hooks(model)
    return _take_markers(model)


def put_in_place(marked: Marked, state: WrapState, reason: str, message: str) -> None:
    """After wrapping a copy again: put its new hooks where the markers were, and note
    where the model came from."""
    handles = state.handles
    for hooks, order in marked:
        _reorder(hooks, order, handles)
    state.log.add(OOOEvent(EventKind.ENABLED, reason, message), level=logging.DEBUG)


def _take_markers(model: nn.Module) -> Marked:
    """Remove every marker; return each dict that had one, with its keys in order (the
    markers themselves standing for the wrapper's hooks)."""
    marked = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, dict) and any(isinstance(v, _WrapperHook) for v in value.values()):
                order = [v if isinstance(v, _WrapperHook) else k for k, v in value.items()]
                for key in [k for k, v in value.items() if isinstance(v, _WrapperHook)]:
                    del value[key]
                marked.append((value, order))
    return marked


def _rekey_loaded_hooks(model: nn.Module) -> None:
    """Give every loaded hook whose id this process may still hand out a fresh id.

    Unpickling in a fresh process brings hook ids its counter never handed out; a new hook
    could get one of them and silently replace a user hook in the same dict. Fresh ids are
    drawn as each hook registration draws one (a ``RemovableHandle``): torch's counter only
    ever moves the ordinary way. Each id is renamed in all of the module's hook dicts
    together (``with_kwargs`` and ``always_call`` share the hook's id); order is kept.
    """
    for module in model.modules():
        dicts = hook_dicts(module)
        first_unused = next_hook_id()
        loaded = sorted({k for d in dicts for k in d if type(k) is int and k >= first_unused})
        if not loaded:
            continue
        fresh = {old: RemovableHandle(dicts[0]).id for old in loaded}
        for hooks in dicts:
            items = list(hooks.items())
            hooks.clear()
            hooks.update((fresh.get(key, key), value) for key, value in items)


def _reorder(hooks: Hooks, order: list[Any], handles: list[RemovableHandle]) -> None:
    """Put the new wrapper hooks where the markers were in ``order``, if they match."""
    keys = []
    for item in order:
        if isinstance(item, _WrapperHook):
            if item.index >= len(handles) or handle_dicts(handles[item.index])[0] is not hooks:
                return  # planned differently this time: keep the order registration gave
            keys.append(handles[item.index].id)
        else:
            keys.append(item)
    for key in keys:
        if key in hooks:
            hooks[key] = hooks.pop(key)  # to the end, in order
