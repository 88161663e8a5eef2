"""``OOOModule``: wrap a model in place (class swap plus hooks), or fall back untouched."""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, SupportsIndex

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from .._compat import forward_hook_dicts, is_compiled_module
from .._errors import OOOConfigError, OOOError, warn_user
from .._events import EventKind, EventLog, OOOEvent
from .._plan import Plan, plural
from .._planner.api import named_stages, plan
from .._planner.cost import GPULike, as_reference_gpu
from .._runtime.accumulators import Accumulators
from .._runtime.backend import AcceleratorBackend, Backend, clock_of
from .._runtime.recompute import install as install_recompute_ordering
from .._runtime.scheduler import Scheduler, running
from .._runtime.variants import scheduler_class
from .._stats import Counters, OOOStats
from .classswap import build_original, wrapped_class
from .learn import Learner, finish, pending_plan
from .options import Planner, Tune, WrapOptions
from .serialize import deepcopy_wrapped, reduce_wrapped
from .tune import Tuner, Tuning

__all__ = ["OOOModule", "events_for", "unwrap"]

logger = logging.getLogger("ooo_wrap")


@dataclass
class _WrapState:
    """Everything the wrapper knows about one wrapped model (kept outside the model)."""

    plan: Plan
    options: WrapOptions
    original_class: type[nn.Module]
    scheduler: Scheduler | None  # None while the plan is being learned, or with no hooks
    handles: list[RemovableHandle]
    log: EventLog
    counters: Counters
    backend: Backend
    learner: Learner | None = None  # the hooks that learn the plan, until it is learned
    tuner: Tuner | None = None  # the hooks that time plain against planned, until decided
    tuning: Tuning | None = None  # the last decided tuning; None if never tuned
    # Which accumulators the wrapper's own forwards made (released when the next forward
    # runs on other streams; _runtime/accumulators.py).
    accumulators: Accumulators = field(default_factory=Accumulators)

    def events(self) -> tuple[OOOEvent, ...]:
        if self.scheduler is not None:
            self.scheduler.sync_compiled_events()
        return self.log.snapshot()

    def remove_hooks(self) -> None:
        """Remove every hook of the wrapper (the model keeps its swapped class)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.scheduler is not None:
            self.scheduler.release()
        if self.tuner is not None:
            self.tuning = self.tuner.record()  # as far as it got
        self.scheduler = self.learner = self.tuner = None

    def stop(self, reason: str, why: str) -> None:
        """No hooks at all from now on: the model runs as if unwrapped (and stays unwrappable)."""
        self.remove_hooks()
        again = (
            "model.replan() learns again on the next training forward"
            if self.options.planner == "dataflow"
            else "model.retune() measures again"
        )
        self.log.add(
            OOOEvent(
                EventKind.DISABLED,
                reason,
                f"{why}; every forward from now on runs the plain model, with no hook at all "
                f"({again})",
            ),
            level=logging.INFO,
        )


# Keyed weakly by the model: nothing here keeps a model alive, and nothing is stored on it.
_wrapped: weakref.WeakKeyDictionary[nn.Module, _WrapState] = weakref.WeakKeyDictionary()
_detached: weakref.WeakKeyDictionary[nn.Module, tuple[OOOEvent, ...]] = weakref.WeakKeyDictionary()

_FALLBACK_MESSAGES = {
    "cpu": "model is on the CPU: standard backward (side streams need an accelerator; "
    "move the model to it before wrapping)",
    "mps": "model is on MPS, which has a single stream: standard backward",
    "no_accelerator": "no stream-capable accelerator for the model's device: standard backward",
    "too_few_stages": "fewer than two stages: nothing to overlap, standard backward (name "
    "stages with stages=[...] or a model.ooo_stage_names attribute)",
    "multi_device": "stages span several devices: standard backward (wrap a model that "
    "lives on one device)",
    "compiled": "the model is torch.compile'd: out-of-order backprop is off, the compiled "
    "path wins (they are mutually exclusive; pick one and benchmark it)",
    "unsupported_module": "TorchScript modules cannot run Python hooks: standard backward",
}


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
        tune: once a plan is in force, alternate plain and planned training steps,
            time each on the device (timing events on the caller's stream, no per-step
            host sync) and keep the plan only if its median step is faster than plain by
            more than the noise; else remove every hook (a ``DISABLED`` event with reason
            ``measured_slower``). ``"auto"`` (the default) tunes where the backend can
            time steps (a real accelerator), ``True`` requires it, ``False`` never tunes.
            ``model.tuning`` shows the measurement.
        tune_steps: counted steps per arm before tuning decides (more pairs run, up to
            three times as many, while the difference is within the noise).
        gpu: the reference GPU the ``dataflow`` planner estimates on: an
            ``ooo_wrap.ReferenceGPU`` or the path of one's JSON (the GPU kit writes one
            measured on its device); ``None`` for the H200 datasheet figures.

    Returns:
        ``model`` itself, wrapped or untouched.

    Raises:
        OOOConfigError: ``model`` is not a module, is already wrapped or is a
            ``DistributedDataParallel`` (wrap first, then DDP), ``streams`` is not a
            positive int, ``profile_ranges`` or ``overlap_forward`` is not a bool,
            ``tune`` is not a bool or ``"auto"``, ``tune=True`` on a backend that cannot
            time steps, ``tune_steps`` is below 2, ``backend`` is not a backend, ``gpu``
            is neither a ``ReferenceGPU`` nor a readable path to one's JSON, or the
            stage names are empty, unknown, repeated, the root, a container or nested
            (see :func:`ooo_wrap.plan`).

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
    ) -> Any:
        if cls is not OOOModule:  # OOO<Cls> has its own __new__ (classswap.py)
            return super().__new__(cls)
        options = WrapOptions(
            streams,
            stages,
            backend,
            profile_ranges,
            planner,
            overlap_forward,
            tune,
            tune_steps,
            as_reference_gpu(gpu),
        )
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
        replan(self)

    @property
    def tuning(self) -> Tuning | None:
        """What measured tuning found: ``None`` if this model never tunes, else a
        :class:`~ooo_wrap.Tuning` whose ``decision`` is ``"pending"`` while measuring."""
        state = _state(self)
        return state.tuner.record() if state.tuner is not None else state.tuning

    def retune(self) -> None:
        """Measure the current plan against the plain model again, from the next forward.

        After a ``measured_slower`` decision it puts the plan's hooks back first. A no-op
        while the plan is still to be learned or tuning is underway.

        Raises:
            OOOConfigError: the model does not tune (``tune=False``, or a backend that
                cannot time), or it has no plan with stages to measure.
        """
        retune(self)

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
        return deepcopy_wrapped(self, _state(self), memo, _rewrap)

    def __copy__(self) -> NoReturn:
        raise OOOError(
            f"copy.copy of a wrapped {type(self).__name__} would share its stages, and so its "
            "hooks, with the original; use copy.deepcopy(model), or ooo_wrap.unwrap(model) first"
        )

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return reduce_wrapped(self, _state(self), _rewrap)


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
    _refuse_inside_forward(model, state, "unwrap()")
    del _wrapped[model]
    state.events()  # moves counts taken in compiled code into the log while it can
    state.remove_hooks()
    model.__class__ = state.original_class
    state.log.add(
        OOOEvent(EventKind.UNWRAPPED, "unwrap", "hooks removed and class restored"),
        level=logging.INFO,
    )
    _detached[model] = state.events()
    return model


def events_for(model: nn.Module) -> tuple[OOOEvent, ...]:
    """The events of ``model``: wrapped, fallen back untouched, or unwrapped.

    Returns ``()`` for a model :class:`OOOModule` never saw.

    Example::

        >>> model = ooo_wrap.OOOModule(cpu_model)   # falls back: returns cpu_model
        >>> ooo_wrap.events_for(model)[-1].reason
        'cpu'
    """
    state = _wrapped.get(model)
    if state is not None:
        return state.events()
    return _detached.get(model, ())


def is_wrapped(model: object) -> bool:
    """Whether ``model`` is a model :class:`OOOModule` wrapped (and has not unwrapped)."""
    return isinstance(model, nn.Module) and model in _wrapped


def plan_pending(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped and its plan is still to be learned: it carries the
    learner's two root hooks and no stage hook yet."""
    state = _wrapped.get(model)
    return state is not None and state.learner is not None


def runs_plain(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped but carries no hook of the wrapper: learning found
    nothing to overlap, or the learned plan could not start (a ``DISABLED`` event says why)."""
    state = _wrapped.get(model)
    return state is not None and state.scheduler is None and state.learner is None


def stage_of(module: object) -> tuple[nn.Module, str] | None:
    """The wrapped model and stage name if ``module`` is a stage with the wrapper's hooks.

    By the hooks, not by name: after model surgery (``model.blocks[1] = new``) the module
    wrapped as the stage keeps the hooks, and the one now at the name has none.
    """
    for model, state in list(_wrapped.items()):
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
    state = _wrapped.get(model)
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
    so forwards that call no stage are expected (see ``Scheduler.stages_replay_in_a_graph``)."""
    state = _wrapped.get(model)
    if state is not None and state.scheduler is not None:
        state.scheduler.stages_replay_in_a_graph()
    if state is not None and state.tuner is not None:
        state.tuner.stop_for_graphs()


def record_fallback(
    model: nn.Module, reason: str, *, warn: bool = False, message: str | None = None
) -> nn.Module:
    """Leave ``model`` untouched, record a ``DISABLED`` event for it and return it; the
    event's message is ``message``, or the reason's usual one."""
    event = OOOEvent(EventKind.DISABLED, reason, message or _FALLBACK_MESSAGES[reason])
    _detached[model] = (event,)
    logger.info("%s", event)
    if warn:
        warn_user(f"ooo_wrap: {event.message}")
    return model


def _too_few_stages(model: nn.Module, the_plan: Plan) -> nn.Module:
    """Fall back for fewer than two stages; where the user named the one stage, the usual
    hint (name stages) would be wrong: say why one is not enough."""
    if the_plan.source not in ("argument", "attribute") or len(the_plan.stages) != 1:
        return record_fallback(model, "too_few_stages")
    name = the_plan.stages[0].name
    if the_plan.source == "argument":
        where, fix = "stages=", f"stages=[{name!r}, ...]"
    else:
        where, fix = "model.ooo_stage_names", f"ooo_stage_names = [{name!r}, ...]"
    return record_fallback(
        model,
        "too_few_stages",
        message=f"{where} names a single stage, {name!r}, which has nothing to overlap "
        "with (stages overlap each other, so it takes two or more): standard backward; "
        f"name two or more sub-modules that can run at the same time ({fix}), or leave "
        "the names out to have the stages found",
    )


def _rewrap(model: nn.Module, options: WrapOptions) -> _WrapState | None:
    """Wrap a copy as ``options`` say: its wrap state, or ``None`` if it fell back."""
    _wrap(model, options)
    return _wrapped.get(model)


def _state(model: nn.Module) -> _WrapState:
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
    _refuse_nested(model)
    if isinstance(model, DistributedDataParallel):
        # Wrapping inside DDP keeps stage names, ooo_stage_names and the plan the model's
        # own (no "module." prefix) and is the order tested on every DDP mode; one order
        # with one clear error beats two that differ subtly.
        raise OOOConfigError(
            "OOOModule got a DistributedDataParallel; wrap the model first, then DDP: "
            "model = DistributedDataParallel(ooo_wrap.OOOModule(model, ...), ...)"
        )
    if is_compiled_module(model):
        return record_fallback(model, "compiled", warn=True)
    if isinstance(model, torch.jit.ScriptModule):
        return record_fallback(model, "unsupported_module")
    backend = options.backend if options.backend is not None else AcceleratorBackend()
    # Devices first: a model that cannot use side streams anyway falls back whatever its
    # layout, without planning it.
    reasons = [backend.unsupported_reason(device) for device in _devices(model)]
    if reasons and all(reason is not None for reason in reasons):
        return _device_fallback(model, str(reasons[0]), options)
    if options.tune is True and clock_of(backend, _devices(model)[0]) is None:
        raise OOOConfigError(
            f"tune=True measures steps on the device, but the {backend.name} backend cannot "
            "time them; pass tune='auto' (tunes where it can) or tune=False, or give "
            "SimulatedBackend a step_time= clock"
        )
    if options.planner == "dataflow":
        return _wrap_learning(model, options, backend)
    the_plan = plan(model, options.streams, stages=options.stages)
    if len(the_plan.stages) < 2:
        return _too_few_stages(model, the_plan)
    if len(the_plan.devices) > 1:
        return record_fallback(model, "multi_device")
    reason = backend.unsupported_reason(the_plan.devices[0])
    if reason is not None:
        return _device_fallback(model, reason, options)
    return _install(model, the_plan, options, backend)


def _wrap_learning(model: nn.Module, options: WrapOptions, backend: Backend) -> nn.Module:
    """Wrap with the learner's hooks only; the plan is learned on the first training forward.

    Named stages are checked now (the same errors as the static plan); automatic stages
    are not known yet, so only a model with no supported device falls back here.
    """
    named = named_stages(model, options.streams, options.stages)
    if named is not None and len(named.stages) < 2:
        return _too_few_stages(model, named)
    devices = [d for d in _devices(model) if backend.unsupported_reason(d) is None]
    if not devices:  # a model with neither parameters nor buffers
        return record_fallback(model, "too_few_stages")
    return _install(model, pending_plan(options.streams), options, backend, devices[0])


def replan(model: nn.Module) -> None:
    """See :meth:`OOOModule.replan`."""
    state = _state(model)
    if state.options.planner != "dataflow":
        raise OOOConfigError(
            "replan() learns the plan from the dataflow, but this model was wrapped with "
            "planner='static'; unwrap it and wrap it again with planner='dataflow'"
        )
    _refuse_inside_forward(model, state, "replan()")
    if state.learner is not None:
        return  # not learned yet: the next training forward learns it anyway
    state.remove_hooks()
    device = state.plan.devices[0] if state.plan.stages else _devices(model)[0]
    _start_learner(state, device)
    assert state.learner is not None
    state.learner.install(model, state.handles)
    state.log.add(
        OOOEvent(EventKind.PLANNED, "replan", "the plan is learned again on the next forward"),
        level=logging.INFO,
    )


def _refuse_inside_forward(model: nn.Module, state: _WrapState, call: str) -> None:
    """Refuse ``call`` while a forward of ``model`` runs on this thread: it removes the
    hooks, so the post-hook of the stage running now (which restores the caller's
    stream) or of the root (which ends the planner's observation) would never run."""
    learner = state.learner
    if running(model, state.scheduler, learner is not None and learner.observing):
        raise OOOError(
            f"{call} was called inside a forward of this {type(model).__name__} (from a "
            "stage's forward, or a hook); it removes the hooks that restore your stream "
            "(and end the planner's observation) when the forward returns, so nothing was "
            "changed. Call it between forwards (a router that decides to replan can set a "
            "flag in forward and call it after the step)"
        )


def _start_learner(state: _WrapState, device: torch.device) -> None:
    options = state.options
    state.plan = pending_plan(options.streams)
    learner = Learner(
        options.streams,
        options.stages,
        state.backend,
        device,
        state.counters,
        state.accumulators,
        gpu=options.gpu,
    )
    # The learner holds no reference to the model (a wrap state must not keep it alive).
    learner.finish = lambda model, the_plan, why: finish(
        model, _state(model), the_plan, why, start_scheduler
    )
    state.learner = learner


def _devices(model: nn.Module) -> list[torch.device]:
    """The distinct devices of the model's parameters and buffers, in model order."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return list(dict.fromkeys(tensor.device for tensor in tensors))


_warned_cpu_with_accelerator = False


def _device_fallback(model: nn.Module, reason: str, options: WrapOptions) -> nn.Module:
    """Fall back for the device; warn (once per process) about the natural mistake of
    wrapping on the CPU and moving the model to the accelerator afterwards."""
    global _warned_cpu_with_accelerator
    accelerator = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    )
    if reason != "cpu" or options.backend is not None or accelerator is None:
        return record_fallback(model, reason)
    record_fallback(model, reason)
    if not _warned_cpu_with_accelerator:
        _warned_cpu_with_accelerator = True
        warn_user(
            f"ooo_wrap: the model is on the CPU but a {accelerator.type} accelerator is "
            "available, so OOOModule left it untouched (moving it afterwards does not wrap "
            f"it); move it first, then wrap: OOOModule(model.to({accelerator.type!r}), ...)"
        )
    return model


def _refuse_nested(model: nn.Module) -> None:
    """One wrapped model may not contain another: both would fork the same calls."""
    for name, sub in model.named_modules(remove_duplicate=False):
        if sub is not model and sub in _wrapped:
            raise OOOConfigError(
                f"sub-module '{name}' of this {type(model).__name__} is already wrapped; "
                "wrap only one of them: ooo_wrap.unwrap() the inner one first, or keep it "
                "and name its parts as stages there"
            )
    for other in list(_wrapped):
        for name, sub in other.named_modules(remove_duplicate=False):
            if sub is model:
                raise OOOConfigError(
                    f"this {type(model).__name__} is sub-module '{name}' of a wrapped "
                    f"{type(other).__name__}; wrap only one of them (name '{name}' or its "
                    "parts as stages of the outer model instead)"
                )


def start_scheduler(model: nn.Module, state: _WrapState, the_plan: Plan) -> None:
    """Create the plan's streams and install its scheduler's hooks into ``state``; on any
    failure, remove the hooks it added and raise."""
    backend = state.backend
    streams = [backend.new_stream(the_plan.devices[0]) for _ in range(the_plan.num_streams)]
    # Picked here, once: the hooks carry no code for the options that are off.
    scheduler_type = scheduler_class(
        overlap_forward=state.options.overlap_forward,
        profile_ranges=state.options.profile_ranges,
    )
    scheduler = scheduler_type(the_plan, streams, backend, state.log, state.counters)
    added: list[RemovableHandle] = []
    try:
        scheduler.install(model, added)
    except Exception:
        for handle in added:
            handle.remove()
        raise
    state.handles += added
    state.plan, state.scheduler = the_plan, scheduler
    scheduler.accumulators = state.accumulators
    _start_tuning(model, state)


def _start_tuning(model: nn.Module, state: _WrapState) -> None:
    """Time plain against planned steps from the next forward on, if the options ask and
    the backend can time (``tune.py``)."""
    scheduler, the_plan = state.scheduler, state.plan
    assert scheduler is not None
    clock = clock_of(state.backend, the_plan.devices[0])
    if state.options.tune is False or clock is None:
        return
    tuner = Tuner(state, scheduler, the_plan.devices[0], clock, state.options.tune_steps)
    tuner.install(model)
    state.tuner, state.tuning = tuner, None


def retune(model: nn.Module) -> None:
    """See :meth:`OOOModule.retune`."""
    state = _state(model)
    _refuse_inside_forward(model, state, "retune()")
    if state.options.tune is False or clock_of(state.backend, _devices(model)[0]) is None:
        raise OOOConfigError(
            "retune() measures the plan on the device, but this model does not tune "
            "(tune=False, or its backend cannot time steps); wrap it with tune=True on an "
            "accelerator"
        )
    if state.learner is not None or state.tuner is not None:
        return  # the plan is still to be learned, or tuning is underway: it will decide
    if not state.plan.stages:
        raise OOOConfigError(
            "retune() has no plan to measure: this model runs plain because "
            f"{_why_plain(state)}; model.replan() learns a plan again"
        )
    if state.scheduler is None:  # plain was measured faster: put the plan's hooks back
        start_scheduler(model, state, state.plan)
        return
    _start_tuning(model, state)


def _why_plain(state: _WrapState) -> str:
    disabled = [e for e in state.log.snapshot() if e.kind is EventKind.DISABLED]
    return disabled[-1].reason if disabled else "it has no stages"


def _install(
    model: nn.Module,
    the_plan: Plan,
    options: WrapOptions,
    backend: Backend,
    learn_on: torch.device | None = None,
) -> nn.Module:
    """Register hooks (the scheduler's, or the learner's when ``learn_on`` names the device
    to learn on) and swap the class; undo all of it on any failure."""
    install_recompute_ordering()  # before the first forward: the learning step's checkpoints too
    original_class = type(model)
    names_before = _names(model)
    log = EventLog()
    state = _WrapState(the_plan, options, original_class, None, [], log, Counters(), backend)
    try:
        if learn_on is None:
            start_scheduler(model, state, the_plan)
        else:
            _start_learner(state, learn_on)
            assert state.learner is not None
            state.learner.install(model, state.handles)
        model.__class__ = wrapped_class(model, original_class, OOOModule)
        if _names(model) != names_before:  # the contract: wrapping renames nothing
            raise RuntimeError("parameter or buffer names changed while wrapping")
        _wrapped[model] = state
    except Exception as error:
        for handle in state.handles:
            handle.remove()
        model.__class__ = original_class
        _wrapped.pop(model, None)
        event = OOOEvent(
            EventKind.SETUP_FAILED,
            type(error).__name__,
            f"setup failed ({error}); hooks removed, model left as it was, standard backward",
        )
        log.add(event, level=logging.WARNING)
        _detached[model] = log.snapshot()
        warn_user(f"ooo_wrap: {event.message}")
        return model
    if learn_on is None:
        what = (
            f"{plural(len(the_plan.stages), 'stage')} on "
            f"{plural(the_plan.num_streams, 'side stream')} ({the_plan.devices[0]}"
        )
    else:
        what = (
            "plan to be learned from the dataflow of the first training forward, which runs "
            f"inline (at most {plural(options.streams, 'side stream')}; {learn_on}"
        )
    log.add(
        OOOEvent(EventKind.ENABLED, backend.name, f"{what}, {backend.name} backend)"),
        level=logging.INFO,
    )
    return model


def _names(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()] + list(model.state_dict())
