"""``from_config``: the trainer-config entry point (``ooo_backprop``, ``ooo_streams``,
``ooo_planner``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from .._errors import OOOConfigError, did_you_mean
from .._plan import check_streams
from .._runtime.backend import Backend
from .._wrapper.fallback import record_fallback
from .._wrapper.module import OOOModule
from .._wrapper.options import check_backend, check_planner, check_split_weight_grads

__all__ = ["from_config"]

_KNOWN_KEYS = (
    "ooo_backprop",
    "ooo_streams",
    "ooo_planner",
    "ooo_overlap_forward",
    "ooo_tune",
    "ooo_split_weight_grads",
)

logger = logging.getLogger("ooo_wrap")


def from_config(
    model: nn.Module, config: Mapping[str, Any], *, backend: Backend | None = None
) -> nn.Module:
    """Wrap ``model`` as a trainer config says; the feature is off unless asked for.

    Keys read: ``ooo_backprop`` (bool, default ``False``), ``ooo_streams`` (positive int,
    default 4), ``ooo_planner`` (``"dataflow"``, the default, or ``"static"``; see
    :class:`OOOModule`), ``ooo_overlap_forward`` (bool, default ``False``: see
    ``overlap_forward`` of :class:`OOOModule`), ``ooo_tune`` (``True``, ``False`` or
    ``"auto"``, the default: see ``tune`` of :class:`OOOModule`),
    ``ooo_split_weight_grads`` (``True``, ``False`` or ``"auto"``, the default: see
    ``split_weight_grads`` of :class:`OOOModule`) and ``compile`` (bool,
    default ``False``: when true the model is returned untouched with a warning, since the
    compiled path wins). Other keys are ignored, but
    an unknown ``ooo_*`` key is an error, so a typo cannot silently turn the feature off.

    Args:
        model: the model to wrap.
        config: the trainer's configuration mapping.
        backend: where streams come from, as for :class:`OOOModule` (the real
            accelerator by default); an object, so an argument rather than a config key.

    Returns:
        ``model``, wrapped by :class:`OOOModule` or untouched.

    Raises:
        OOOConfigError: an unknown ``ooo_*`` key, a value of the wrong type, or a
            ``backend`` that is not a backend.

    Example::

        >>> model = ooo_wrap.from_config(model, {"ooo_backprop": True, "ooo_streams": 4})
    """
    if not isinstance(config, Mapping):
        raise OOOConfigError(f"config must be a mapping, got {type(config).__name__}")
    for key in config:
        if isinstance(key, str) and key.startswith("ooo_") and key not in _KNOWN_KEYS:
            raise OOOConfigError(
                f"unknown config key {key!r}{did_you_mean(key, _KNOWN_KEYS)} "
                f"(known: {', '.join(_KNOWN_KEYS)})"
            )
    enabled = _flag(config, "ooo_backprop")
    compiled = _flag(config, "compile")
    overlap_forward = _flag(config, "ooo_overlap_forward")
    streams = check_streams(config.get("ooo_streams", 4), "config['ooo_streams']")
    planner = check_planner(config.get("ooo_planner", "dataflow"), "config['ooo_planner']")
    tune = config.get("ooo_tune", "auto")
    if not (isinstance(tune, bool) or tune == "auto"):
        raise OOOConfigError(f"config['ooo_tune'] must be true, false or 'auto', got {tune!r}")
    split = check_split_weight_grads(
        config.get("ooo_split_weight_grads", "auto"), "config['ooo_split_weight_grads']"
    )
    if backend is not None:
        check_backend(backend)
    if not enabled:
        logger.debug("ooo_backprop is off in the config; model left untouched")
        return model
    if compiled:
        return record_fallback(model, "compiled", warn=True)
    wrapped: nn.Module = OOOModule(
        model,
        streams,
        backend=backend,
        planner=planner,
        overlap_forward=overlap_forward,
        tune=tune,
        split_weight_grads=split,
    )
    return wrapped


def _flag(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise OOOConfigError(f"config[{key!r}] must be true or false, got {value!r}")
    return value
