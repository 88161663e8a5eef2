"""The class swap: a cached subclass of ``OOOModule`` and the model's class, per model class.

Wrapping changes only ``model.__class__`` (like FSDP2's ``FSDP<ClassName>``), so
``isinstance`` checks, parameter names and ``state_dict()`` keys stay the model's. The
class keeps the model's ``__name__`` (code that records a model's class name, such as
``save_pretrained``'s ``architectures`` or ``print(model)``, writes what it would for the
plain model) and has ``__qualname__`` ``OOO<ClassQualname>``, so ``repr(type(model))``
shows that it is wrapped.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from .._errors import warn_user

__all__ = ["build_original", "wrapped_class"]

_API_NAMES = ("events", "plan", "stats", "unwrap")

# (model class, names left to the model) -> wrapped class; classes live for the process.
_classes: dict[tuple[type[nn.Module], tuple[str, ...]], type[nn.Module]] = {}
_warned_shadowed: set[tuple[type[nn.Module], str]] = set()


class _LeftToModel:
    """A non-data descriptor that hides a wrapper API name: instance lookup falls through
    to the model's own ``__dict__`` or its ``nn.Module.__getattr__`` (sub-modules,
    parameters, buffers)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        raise AttributeError(self._name)


def wrapped_class(model: nn.Module, cls: type[nn.Module], base: type[nn.Module]) -> type[nn.Module]:
    """The cached ``(base, cls)`` class for ``model``, whose class is ``cls``: named as
    ``cls``, with qualified name ``OOO<cls qualname>``.

    Names of the wrapper's API that the model already has (on its class, or as an
    attribute, sub-module, parameter or buffer) stay the model's, with a one-time warning.
    """
    missing = object()
    on_class = {n for n in _API_NAMES if inspect.getattr_static(cls, n, missing) is not missing}
    own = {
        *vars(model),
        *(name for name, _ in model.named_children()),
        *(name for name, _ in model.named_parameters(recurse=False, remove_duplicate=False)),
        *(name for name, _ in model.named_buffers(recurse=False, remove_duplicate=False)),
    }
    on_instance = {n for n in _API_NAMES if n in own}
    shadowed = tuple(sorted(on_class | on_instance))
    for name in shadowed:
        if (cls, name) not in _warned_shadowed:
            _warned_shadowed.add((cls, name))
            warn_user(
                f"ooo_wrap: {cls.__name__} already has {name!r}; it stays the model's. Use "
                f"ooo_wrap.events_for(model), ooo_wrap.unwrap(model) or "
                f"ooo_wrap.OOOModule.{name} for the wrapper's"
            )
    key = (cls, shadowed)
    if key not in _classes:
        namespace: dict[str, Any] = {
            "_ooo_dynamic": True,
            "_ooo_original": cls,
            "__new__": _new_blank,
            "__module__": cls.__module__,
            "__qualname__": f"OOO{cls.__qualname__}",
        }
        for name in shadowed:
            namespace[name] = (
                inspect.getattr_static(cls, name) if name in on_class else _LeftToModel(name)
            )
        # Same __name__ as the model's class: names recorded from the class (a saved
        # config's architectures, module repr, error messages) match the plain model's.
        # Pickle and copy never look this class up by name (see serialize.py).
        _classes[key] = type(cls.__name__, (base, cls), namespace)
    return _classes[key]


def _new_blank(cls: type[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """``OOO<Cls>.__new__``: a blank instance, whatever the arguments.

    Called with none by copy, pickle and DataParallel's replicas, which then fill in the
    state; called with the original class's arguments by code that rebuilds a module
    through its class (``sequential[0:2]``, ``type(m)(...)``), after which ``type.__call__``
    runs ``OOOModule.__init__``, which finishes the job with :func:`build_original`.
    """
    original: type[nn.Module] = cls.__dict__["_ooo_original"]
    return original.__new__(cls)


def build_original(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Turn a blank ``OOO<Cls>`` made by ``OOO<Cls>(*args, **kwargs)`` into a plain ``Cls``.

    Like ``FSDPModule.__new__``: rebuilding a wrapped module through its class gives a
    working module of the original class (unwrapped), not a half-built wrapper. Modules
    that are already built (the model ``OOOModule(model)`` returns) are left alone.
    """
    original = type(module).__dict__.get("_ooo_original")
    if original is None or vars(module):
        return
    module.__class__ = original
    original.__init__(module, *args, **kwargs)
