"""``OOOModule`` and the public functions: wrap a model in place (class swap plus hooks),
or fall back untouched; unwrap, replan, retune; copies and pickles wrapped again.

The layers below: ``fallback.py`` (when the model is left untouched), ``lifecycle.py``
(the wrap state machine: every hook added or removed), ``registry.py`` (which models are
wrapped), ``serialize.py`` (plain copies), ``classswap.py`` (the swapped class).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, NoReturn, SupportsIndex

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._compat import is_compiled_module, streaming_names_found
from .._errors import OOOConfigError, OOOError, warn_user
from .._events import EventKind, EventLog, OOOEvent
from .._plan import Plan, plural
from .._planner.cost import GPULike, as_reference_gpu
from .._reasons import Reason
from .._runtime.backend import AcceleratorBackend, Backend
from .._runtime.recompute import install as install_recompute_ordering
from .._stats import OOOStats
from .classswap import build_original, wrapped_class
from .fallback import UNTOUCHED, record_fallback, refuse_nested, what_to_install
from .lifecycle import WrapState, devices
from .options import Planner, SplitWeightGrads, Tune, WrapOptions, check_split_exclude
from .registry import detached as _detached
from .registry import wrapped as _wrapped
from .serialize import new_instance, plain_deepcopy, plain_state, put_in_place, take_markers
from .tuning import Tuning

__all__ = ["OOOModule", "unwrap"]


class OOOModule(nn.Module):
    """Out-of-order backprop for ``model``, in place: ``model = OOOModule(model, streams=4)``.

    Each stage (a sub-module; stages may share sub-modules but not nest) runs its forward
    on a side stream, so autograd runs
    its backward there too and independent branches overlap, with the same gradients.
    The model object is returned with its class swapped to a cached subclass (named as
    the model's class, qualified name ``OOO<ClassName>``): ``isinstance`` checks, class
    names, parameter names and ``state_dict()`` keys are unchanged.
    Where the scheme cannot help (CPU or MPS model, no accelerator, fewer than two stages,
    a compiled or TorchScript model) the model is returned untouched and
    :func:`events_for` says why; the device is checked first, so a CPU model falls back
    whatever its layout (with a one-time warning if an accelerator is available). Code
    that rebuilds a wrapped module through its class (``model[0:2]``, ``type(model)(...)``)
    gets a plain module of the original class.

    Args:
        model: the model to wrap.
        streams: the most side streams to use.
        stages: dotted sub-module names to use as stages (see :func:`ooo_wrap.plan`);
            with the ``dataflow`` planner their streams are still learned.
        backend: where streams come from; the real accelerator by default, or
            :class:`ooo_wrap.testing.SimulatedBackend` to run the hooks on a CPU model.
        profile_ranges: run each stage's forward inside
            ``torch.profiler.record_function("ooo/<stage name>")`` so traces show stage
            names; off by default, and free when off.
        planner: ``"dataflow"`` (the default) runs the first training forward inline while
            observing its dataflow, then puts the parallel branches it found on side
            streams (or, finding none, removes every hook: a ``DISABLED`` event with
            reason ``no_parallelism``); ``"static"`` uses the stage names or automatic
            expansion with round-robin streams from the start.
        overlap_forward: leave each stage's join with the caller's stream pending until
            something touches its outputs (the next stage that receives them, any torch
            operation or host read in the caller's code, the end of the forward), so
            independent stages overlap in forward, and under ``torch.no_grad`` too;
            off by default.
        tune: race the candidate arms (plain, the learned regions, the stage rule, the
            weight-gradient split, both) over training steps timed on the device; keep
            the fastest only if it beats plain in a confirmation round, else remove every
            hook (``measured_slower``). ``"auto"`` (the default) where the backend can
            time steps, ``True`` requires it. ``model.tuning`` shows the race.
        tune_steps, tune_arms, tune_arm: counted steps per arm per round; the most
            arms raced besides plain (3); one arm to run by name, racing nothing.
        tune_cache: where decisions are remembered (``False``: nowhere; ``None``:
            ``OOO_WRAP_CACHE`` or ``~/.cache/ooo_wrap``); docs/tuning-and-performance.md.
        tune_cache_confirm: time a cached arm (not plain) alone against plain before
            keeping it (off: it stands); not faster: plain is kept, the cache overwritten.
        gpu: the reference GPU the ``dataflow`` planner estimates on: an
            ``ooo_wrap.ReferenceGPU`` or the path of one's JSON (the GPU kit writes one
            measured on its device); ``None`` for the H200 datasheet figures.
        split_weight_grads: out-of-order weight gradients: each ``nn.Linear`` and
            ``nn.Conv1d/2d/3d`` call (and layer types added with
            ``ooo_wrap.register_split_layer``) computes its weight gradient on a
            weight-gradient stream, so the next layer's input gradient overlaps it; this
            works on chains (whose plan is then the split alone). ``True``: in every
            planned arm; ``"auto"`` (the default): arms with and without it are raced
            (tuning off: never); ``False``: never. docs/weight-gradients.md.
        split_weight_grads_exclude: names of sub-modules whose layers are never split.

    Returns:
        ``model`` itself, wrapped or untouched.

    Raises:
        OOOConfigError: ``model`` is not a module, is already wrapped or is a
            ``DistributedDataParallel`` (wrap first, then DDP), ``streams`` is not a
            positive int, ``profile_ranges``, ``overlap_forward`` or
            ``tune_cache_confirm`` is not a bool, ``tune`` is not a bool or ``"auto"``,
            ``tune=True`` on a backend that cannot time steps, ``tune_steps`` below 2 or
            ``tune_arms`` below 1, ``backend`` is not a backend, ``gpu`` is neither a
            ``ReferenceGPU`` nor a readable path to one's JSON, ``split_weight_grads`` is
            not a bool or ``"auto"``,
            ``split_weight_grads_exclude`` names no sub-module, or the stage names are
            empty, unknown, repeated, the root, a container or nested (:func:`ooo_wrap.plan`).

    Example::

        >>> model = ooo_wrap.OOOModule(model, streams=4)
        >>> loss = model(x).sum(); loss.backward()
        >>> print(model.plan); print(model.events); print(model.stats)
    """

    def __new__(
        cls,
        model: nn.Module | None = None,
        streams: int = 4,
        *,
        stages: Sequence[str] | None = None,
        backend: Backend | None = None,
        profile_ranges: bool = False,
        planner: Planner = "dataflow",
        overlap_forward: bool = False,
        tune: Tune = "auto",
        tune_steps: int = 6,
        gpu: GPULike | None = None,
        split_weight_grads: SplitWeightGrads = "auto",
        split_weight_grads_exclude: Sequence[str] = (),
        tune_arms: int = 3,
        tune_arm: str | None = None,
        tune_cache: str | os.PathLike[str] | bool | None = None,
        tune_cache_confirm: bool = False,
    ) -> Any:
        if cls is not OOOModule:  # OOO<Cls> has its own __new__ (classswap.py)
            return super().__new__(cls)
        options = WrapOptions(
            streams, stages, backend, profile_ranges, planner, overlap_forward, tune,
            tune_steps, as_reference_gpu(gpu), split_weight_grads, split_weight_grads_exclude,
            tune_arms, tune_arm, tune_cache, tune_cache_confirm,
        )  # fmt: skip
        return _wrap(model, options)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # type.__call__ calls __init__ on what __new__ returned: the wrapped model, left
        # exactly as it is, or a blank OOO<Cls>(...) made by code rebuilding a wrapped
        # module through its class, which becomes a plain module of the original class.
        build_original(self, args, kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Allowed: our own cached OOO<Cls>, and a subclass of one made by another in-place
        # wrapper applied after us (fully_shard(model) swaps the class to FSDP<OOO<Cls>>).
        if not any(base.__dict__.get("_ooo_dynamic", False) for base in cls.__mro__):
            raise TypeError(
                "OOOModule is not subclassed; wrap an instance instead: OOOModule(model)"
            )
        super().__init_subclass__(**kwargs)

    @property
    def events(self) -> tuple[OOOEvent, ...]:
        """What the wrapper decided and did, oldest first (bounded, deduplicated)."""
        return _state(self).events()

    @property
    def plan(self) -> Plan:
        """The stages and the side stream each one runs on; with the ``dataflow`` planner,
        before the first training forward, a plan that says it is still to be learned."""
        return _state(self).plan

    def replan(self) -> None:
        """Learn the plan again on the next training forward (``dataflow`` planner only).

        For models whose structure changes (MoE routing, auxiliary heads switched on).
        Call it between forwards: the scheduler's hooks are removed now, and the next
        training forward runs inline while it is observed. Raises :class:`OOOError`
        inside a forward of the model (it changes nothing then).
        """
        _state(self).replan(self)

    @property
    def tuning(self) -> Tuning | None:
        """What measured tuning found: ``None`` if this model never tunes, else a
        :class:`~ooo_wrap.Tuning` whose ``decision`` is ``"pending"`` while measuring."""
        return _state(self).tuning()

    def retune(self) -> None:
        """Measure the current plan against the plain model again, from the next forward.

        After a ``measured_slower`` decision it puts the plan's hooks back first. A no-op
        while the plan is still to be learned or tuning is underway.

        Raises:
            OOOConfigError: the model does not tune (``tune=False``, or a backend that
                cannot time), or it has no plan with stages to measure.
        """
        _state(self).retune(self)

    @property
    def stats(self) -> OOOStats:
        """Counters of forwards, stage calls, waits, record_stream calls, joins, bypasses."""
        return _state(self).counters.snapshot()

    def unwrap(self) -> nn.Module:
        """Remove every hook and restore the model's class; returns the plain model.

        The model is then exactly the plain model, which has no ``unwrap`` method (nothing
        of the wrapper stays on it): where it may already be unwrapped, or never was
        wrapped, call :func:`ooo_wrap.unwrap`, which does nothing there. Raises
        :class:`OOOConfigError` if ``fully_shard(model)`` was applied after wrapping, and
        :class:`OOOError` inside a forward of the model (it changes nothing then).
        """
        return unwrap(self)

    # Copies and pickles are of the plain model, wrapped again with the same options:
    # the scheduler (thread-local state, streams) is never copied. See serialize.py.

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        clone = plain_deepcopy(self, _state(self), memo)
        _wrap_again(
            clone,
            _state(self).options,
            "deepcopy",
            "a deep copy of a wrapped model, wrapped again with the same options: its own "
            "hooks, streams, events and stats (the original's stay with the original)",
        )
        return clone

    def __copy__(self) -> NoReturn:
        raise OOOError(
            f"copy.copy of a wrapped {type(self).__name__} would share its stages, and so its "
            "hooks, with the original; use copy.deepcopy(model), or ooo_wrap.unwrap(model) first"
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        state = _state(self)
        payload = (plain_state(self, state), state.options)
        # The 6th item (state_setter) runs after the state is loaded: the model is rebuilt
        # first, so references back to it inside its own state resolve to the new object.
        return (new_instance, (state.original_class,), payload, None, None, _restore)


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :class:`OOOModule` on ``model`` (in place) and return it; a no-op if not wrapped.

    Raises:
        OOOConfigError: another in-place wrapper (e.g. ``fully_shard``) swapped the class
            again after wrapping; restoring ours would silently drop that wrapper's class.
    """
    state = _wrapped.get(model)
    if state is None:
        return model
    if not type(model).__dict__.get("_ooo_dynamic", False):  # e.g. now FSDP<OOO<Cls>>
        raise OOOConfigError(
            f"cannot unwrap this {type(model).__name__}: its class was swapped again after "
            f"wrapping (by an in-place wrapper such as fully_shard); restoring "
            f"{state.original_class.__name__} would drop that wrapper. Unwrap before "
            "applying it, or apply it first and OOOModule last"
        )
    state.unwrap(model)  # refused inside a forward of the model, changing nothing
    del _wrapped[model]
    model.__class__ = state.original_class
    _detached[model] = state.events()
    return model


def _state(model: nn.Module) -> WrapState:
    state = _wrapped.get(model)
    if state is None:  # e.g. a copy made through pickle without re-wrapping
        raise OOOConfigError(
            f"this {type(model).__name__} is not wrapped; wrap it with ooo_wrap.OOOModule(model)"
        )
    return state


def _wrap(model: object, options: WrapOptions) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise OOOConfigError(
            f"OOOModule expects a torch.nn.Module, got {type(model).__name__}; "
            "pass the model: OOOModule(model)"
        )
    if isinstance(model, OOOModule) or model in _wrapped:
        raise OOOConfigError(
            f"this {type(model).__name__} is already wrapped; call model.unwrap() first "
            "to wrap it again with other options"
        )
    refuse_nested(model)
    check_split_exclude(model, options.split_weight_grads_exclude)
    if isinstance(model, DistributedDataParallel):
        # Wrapping inside DDP keeps stage names, ooo_stage_names and the plan the model's
        # own (no "module." prefix) and is the order tested on every DDP mode; one order
        # with one clear error beats two that differ subtly.
        raise OOOConfigError(
            "OOOModule got a DistributedDataParallel; wrap the model first, then DDP: "
            "model = DistributedDataParallel(ooo_wrap.OOOModule(model, ...), ...)"
        )
    if is_compiled_module(model):
        return record_fallback(model, Reason.COMPILED, warn=True)
    if isinstance(model, torch.jit.ScriptModule):
        return record_fallback(model, Reason.UNSUPPORTED_MODULE)
    # Never stream without what keeps it correct: checkpoint recomputations ordered for
    # their readers, every tensor in a stage's inputs found, stale calls found on the
    # stack (each missing name is warned about once).
    if not install_recompute_ordering() or not streaming_names_found():
        return record_fallback(model, Reason.UNSUPPORTED_TORCH)
    backend = options.backend if options.backend is not None else AcceleratorBackend()
    found = what_to_install(model, options, backend)
    if found is None:
        return model
    the_plan, learn_on = found
    return _install(model, the_plan, options, backend, learn_on)


def _install(
    model: nn.Module,
    the_plan: Plan,
    options: WrapOptions,
    backend: Backend,
    learn_on: torch.device | None,
) -> nn.Module:
    """Register hooks (the scheduler's, or the learner's when ``learn_on`` names the device
    to learn on) and swap the class; undo all of it on any failure."""
    original_class = type(model)
    names_before = _names(model)
    log = EventLog()
    state = WrapState(
        plan=the_plan, options=options, original_class=original_class, backend=backend, log=log
    )
    try:
        state.start(model, learn_on)
        model.__class__ = wrapped_class(model, original_class, OOOModule)
        if _names(model) != names_before:  # the contract: wrapping renames nothing
            raise RuntimeError("parameter or buffer names changed while wrapping")
        _wrapped[model] = state
    except Exception as error:
        state.close()
        model.__class__ = original_class
        _wrapped.pop(model, None)
        event = OOOEvent(
            EventKind.SETUP_FAILED,
            type(error).__name__,
            f"setup failed ({error}); hooks removed, model left as it was, standard "
            f"backward{UNTOUCHED}",
        )
        log.add(event, level=logging.WARNING)
        _detached[model] = log.snapshot()
        warn_user(f"ooo_wrap: {event.message}")
        return model
    if learn_on is None and not the_plan.stages:
        what = f"the weight-gradient split alone ({devices(model)[0]}"
    elif learn_on is None:
        what = (
            f"{plural(len(the_plan.stages), 'stage')} on "
            f"{plural(the_plan.num_streams, 'side stream')} ({the_plan.devices[0]}"
        )
    else:
        what = (
            "plan to be learned from the dataflow of the first training forward, which runs "
            f"inline (at most {plural(options.streams, 'side stream')}; {learn_on}"
        )
    untuned = not state.tunes(model) and options.tune_arm is None
    unmeasured = "; not tuned: the planner's choice runs, nothing is measured" * untuned
    log.add(
        OOOEvent(EventKind.ENABLED, backend.name, f"{what}, {backend.name} backend){unmeasured}"),
        level=logging.INFO,
    )
    return model


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()] + list(model.state_dict())


def _wrap_again(model: nn.Module, options: WrapOptions, reason: str, message: str) -> None:
    """Wrap a plain copy (with markers) as ``options`` say, its new hooks in the markers'
    places, noting where it came from; or leave it plain (a fallback)."""
    marked = take_markers(model)
    _wrap(model, options)
    state = _wrapped.get(model)
    if state is not None:
        put_in_place(marked, state, reason, message)


def _restore(model: nn.Module, payload: tuple[dict[str, Any], WrapOptions]) -> None:
    """A pickle's state setter: load the plain state into ``model`` and wrap it again (or
    let it fall back). Part of the pickle format of wrapped models (see serialize.py)."""
    module_state, options = payload
    model.__setstate__(module_state)  # type: ignore[no-untyped-call]  # untyped in torch
    _wrap_again(
        model,
        options,
        "unpickled",
        "loaded from a pickle of a wrapped model and wrapped again with the same options",
    )
