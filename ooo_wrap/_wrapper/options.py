"""The options of one wrap, checked once and kept as frozen data (copies re-wrap with them)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import nn
from typing_extensions import get_protocol_members

from .._errors import OOOConfigError, did_you_mean
from .._plan import as_stage_names, check_streams
from .._planner.cost import ReferenceGPU, as_reference_gpu
from .._runtime.backend import Backend
from .cache import cache_dir

__all__ = [
    "PLANNERS",
    "Planner",
    "SplitWeightGrads",
    "Tune",
    "WrapOptions",
    "check_backend",
    "check_planner",
    "check_split_exclude",
    "check_split_weight_grads",
]

Planner = Literal["dataflow", "static"]
Tune = bool | Literal["auto"]
SplitWeightGrads = bool | Literal["auto"]
PLANNERS: tuple[Planner, ...] = ("dataflow", "static")


@dataclass(frozen=True)
class WrapOptions:
    """What :class:`~ooo_wrap.OOOModule` was asked for, validated on construction.

    Kept in the wrap state (never on the model) so that ``copy.deepcopy`` and ``pickle``
    can wrap the copy exactly as the original was wrapped.

    Attributes:
        streams: the most side streams to use, a positive int.
        stages: dotted stage names, stored as a tuple; ``None`` for the model's
            ``ooo_stage_names`` or automatic expansion.
        backend: where streams come from; ``None`` for the real accelerator.
        profile_ranges: run each stage's forward inside
            ``torch.profiler.record_function("ooo/<stage name>")``.
        planner: ``"dataflow"`` learns the stages and streams from the first training
            forward; ``"static"`` takes the stage names (or automatic expansion) and
            assigns streams round-robin, without observing anything.
        overlap_forward: leave each stage's join pending until its output is touched,
            so independent stages overlap in forward too.
        tune: time plain against planned training steps on the device and keep the plan
            only if it is measurably faster: ``"auto"`` where the backend can time,
            ``True`` (the backend must be able to) or ``False``.
        tune_steps: counted steps per arm before tuning first decides, at least 2.
        gpu: the reference GPU the planner estimates on (a measured one, from the GPU
            kit); ``None`` for the default, the H200 datasheet figures.
        split_weight_grads: run each ``nn.Linear`` / ``nn.ConvNd`` layer's weight
            gradient on a weight-gradient stream: ``True`` in every planned forward,
            ``"auto"`` only where tuning races it (kept only if measured faster),
            ``False`` never.
        split_weight_grads_exclude: dotted names of sub-modules whose layers are never
            split (each layer below a name is left alone).
        tune_arms: the most candidate arms tuning races besides plain, at least 1.
        tune_arm: the name of one arm to run with nothing raced (``"regions"``,
            ``"wgrad"``, ...: ``model.tuning`` lists them), to reproduce a run; ``None``
            to race.
        tune_cache: where tuning decisions are remembered: ``None`` for the
            ``OOO_WRAP_CACHE`` environment variable or the user's cache directory,
            ``False`` (or ``"off"``) for nowhere, or a directory.
        tune_cache_confirm: a cached arm other than plain is not taken as is but timed
            alone against plain on fresh steps (the tuner's confirmation round), kept
            only if faster there; else plain is kept and the cached record overwritten.
    """

    streams: int = 4
    stages: Sequence[str] | None = None
    backend: Backend | None = None
    profile_ranges: bool = False
    planner: Planner = "dataflow"
    overlap_forward: bool = False
    tune: Tune = "auto"
    tune_steps: int = 6
    gpu: ReferenceGPU | None = None
    split_weight_grads: SplitWeightGrads = "auto"
    split_weight_grads_exclude: Sequence[str] = ()
    tune_arms: int = 3
    tune_arm: str | None = None
    tune_cache: str | os.PathLike[str] | bool | None = None
    tune_cache_confirm: bool = False

    def __post_init__(self) -> None:
        check_split_weight_grads(self.split_weight_grads, "split_weight_grads")
        exclude = as_stage_names(self.split_weight_grads_exclude, "split_weight_grads_exclude=")
        object.__setattr__(self, "split_weight_grads_exclude", tuple(exclude))
        check_streams(self.streams)
        object.__setattr__(self, "gpu", as_reference_gpu(self.gpu))
        if self.stages is not None:
            # A tuple, normalised once here, so that the frozen options stay immutable.
            object.__setattr__(self, "stages", tuple(as_stage_names(self.stages, "stages=")))
        if self.backend is not None:
            check_backend(self.backend)
        if not isinstance(self.profile_ranges, bool):
            raise OOOConfigError(
                f"profile_ranges must be True or False, got {self.profile_ranges!r}; "
                "pass profile_ranges=True to see stage names in profiler traces"
            )
        if not isinstance(self.overlap_forward, bool):
            raise OOOConfigError(
                f"overlap_forward must be True or False, got {self.overlap_forward!r}; "
                "pass overlap_forward=True to let independent stages overlap in forward"
            )
        check_planner(self.planner, "planner")
        if not (isinstance(self.tune, bool) or self.tune == "auto"):
            raise OOOConfigError(
                f"tune must be True, False or 'auto', got {self.tune!r}; 'auto' (the default) "
                "measures the plan against the plain model wherever the device can time steps"
            )
        arms = self.tune_arms
        if isinstance(arms, bool) or not isinstance(arms, int) or arms < 1:
            raise OOOConfigError(
                f"tune_arms must be an int of at least 1, got {arms!r}: the most candidate "
                "arms tuning races besides plain; the default is 3"
            )
        if self.tune_arm is not None and not isinstance(self.tune_arm, str):
            raise OOOConfigError(
                f"tune_arm must be an arm's name or None, got {self.tune_arm!r}; "
                "model.tuning lists the arms a tuning raced (e.g. 'regions', 'wgrad')"
            )
        cache_dir(self.tune_cache)  # a setting that names no directory is refused now
        if not isinstance(self.tune_cache_confirm, bool):
            raise OOOConfigError(
                f"tune_cache_confirm must be True or False, got {self.tune_cache_confirm!r}; "
                "pass tune_cache_confirm=True to time a cached arm against plain before "
                "keeping it"
            )
        steps = self.tune_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
            raise OOOConfigError(
                f"tune_steps must be an int of at least 2, got {steps!r}: the counted steps "
                "per arm (plain and planned) before tuning decides; the default is 6"
            )


def check_planner(planner: object, where: str) -> Planner:
    """Return ``planner`` if it names a planner, else raise :class:`OOOConfigError`."""
    for known in PLANNERS:
        if planner == known and isinstance(planner, str):
            return known
    raise OOOConfigError(
        f"{where} must be one of {', '.join(map(repr, PLANNERS))}, got {planner!r}; "
        "'dataflow' learns the plan from the first training forward, 'static' uses stage "
        "names or automatic expansion with round-robin streams"
    )


def check_backend(backend: object) -> None:
    """Raise :class:`OOOConfigError` unless ``backend`` has every member of ``Backend``."""
    missing = sorted(
        name
        for name in get_protocol_members(Backend)
        if not hasattr(backend, name) or (name != "name" and not callable(getattr(backend, name)))
    )
    if missing:
        raise OOOConfigError(
            f"backend must be a stream backend (None for the real accelerator, or e.g. "
            f"ooo_wrap.testing.SimulatedBackend()), got {backend!r} of type "
            f"{type(backend).__name__}, which lacks {', '.join(missing)}"
        )


def check_split_weight_grads(value: object, where: str) -> SplitWeightGrads:
    """Return ``value`` if it is ``True``, ``False`` or ``"auto"``, else raise
    :class:`OOOConfigError` naming ``where``."""
    if isinstance(value, bool):
        return value
    if value == "auto" and isinstance(value, str):
        return "auto"
    raise OOOConfigError(
        f"{where} must be True, False or 'auto', got {value!r}; 'auto' (the default) races "
        "the weight-gradient split where tuning measures the plan, True splits every "
        "nn.Linear / nn.ConvNd weight gradient in each planned forward, False never"
    )


def check_split_exclude(model: nn.Module, names: Sequence[str]) -> None:
    """Raise :class:`OOOConfigError` for a name in ``names`` that is no sub-module."""
    known = {name for name, _ in model.named_modules() if name}
    for name in names:
        if name not in known:
            raise OOOConfigError(
                f"split_weight_grads_exclude names {name!r}, which is no sub-module of this "
                f"{type(model).__name__}{did_you_mean(name, sorted(known))}; use the dotted "
                "names of model.named_modules()"
            )
