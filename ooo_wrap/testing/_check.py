"""``check()``: train a copy of a model on virtual streams under the race detector."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._errors import OOOConfigError, positive_int
from .._events import EventKind
from .._plan import plural
from .._planner.cost import H200, GPULike, as_reference_gpu
from .._planner.learned_plan import learned_of
from .._tensors import map_leaves, named_tensors
from .._wrapper.module import OOOModule
from .._wrapper.options import Planner, SplitWeightGrads
from .._wrapper.registry import events_for, runs_plain
from ._detect import DetectingBackend, detect
from ._detection import Detection
from ._engine import CHECKED_TORCH
from ._report import CheckReport, ParityEntry, count_ops

__all__ = ["check"]

_LR = 1e-3  # the plain SGD step both copies take, so step 2 runs on updated weights
_SEED = 0  # both copies draw the same random numbers (dropout), without touching the caller's

_Named = dict[str, torch.Tensor]
_Kwargs = dict[str, Any]


def check(
    model: nn.Module,
    *inputs: Any,
    example_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    streams: int = 4,
    stages: Sequence[str] | None = None,
    steps: int = 2,
    planner: Planner = "dataflow",
    overlap_forward: bool = False,
    capture: bool = False,
    gpu: GPULike | None = None,
    split_weight_grads: SplitWeightGrads = "auto",
) -> CheckReport:
    """Train a copy of ``model`` on virtual streams and report every stream race.

    A deep copy is wrapped with :class:`~ooo_wrap.OOOModule` on a simulated backend and
    trained for ``steps`` steps (forward, loss, backward, then every ``.grad`` read on the
    caller's stream by a plain SGD update, as an optimizer would) while every op is checked
    for unordered cross-stream accesses and for uses without ``record_stream``. A second
    copy trains the same steps unwrapped, and outputs and gradients are compared. The
    caller's model, inputs and random state are left untouched. Runs on the CPU.

    Args:
        model: a CPU model, not wrapped.
        inputs: the positional inputs of one forward call (tensors, or nests of them).
        example_kwargs: its keyword inputs (``attention_mask=...``), as for
            :func:`ooo_wrap.plan`.
        loss_fn: maps the model's output to a scalar loss; by default the sum of every
            floating-point tensor in the output.
        streams: side streams, as for :class:`~ooo_wrap.OOOModule`.
        stages: stage names, as for :class:`~ooo_wrap.OOOModule`.
        steps: training steps to run. With the ``dataflow`` planner the first step runs
            inline while the plan is learned, and the later steps check the learned plan
            (so at least 2 are needed to check anything).
        planner: as for :class:`~ooo_wrap.OOOModule`.
        overlap_forward: check the wrapper with deferred joins, as
            ``OOOModule(..., overlap_forward=True)`` runs it.
        capture: run the last step (forward, loss, backward and the SGD update) under a
            simulated CUDA graph capture, the earlier ones eagerly as warm-up, as
            ``torch.cuda.graph`` is used. The rules a real capture enforces are checked
            (every stream used joins through an event recorded during the capture and
            rejoins before its end, no host read or other host sync inside); parity
            with the plain copy is still bitwise. With the ``dataflow`` planner it needs
            ``steps >= 2``: the plan is learned on an eager first step.
        gpu: the reference GPU of the estimates (the wrapper's planner, each op's cost,
            the report's timeline): an ``ooo_wrap.ReferenceGPU`` or the path of one's
            JSON, such as the GPU kit measures; ``None`` for the H200 datasheet figures.
        split_weight_grads: as for :class:`~ooo_wrap.OOOModule`; ``True`` checks every
            split layer's weight gradient on the weight-gradient stream (the checker does
            not tune, so ``"auto"``, the default, leaves it off).

    Returns:
        a :class:`CheckReport`; ``report.ok`` when nothing was found and parity is bitwise.
        Where the model runs plain, with no side stream (the wrapper fell back, e.g. for
        fewer than two stages, or the ``dataflow`` planner learned ``no_parallelism`` and
        removed its hooks), there is nothing to check: ``report.ok`` is false and
        ``report.not_checked`` says why.

    Raises:
        OOOConfigError: ``model`` is already wrapped, ``steps`` is not a positive int
            (or below 2 with ``capture`` and the ``dataflow`` planner), or the output
            has no floating-point tensor that requires grad (pass ``loss_fn``), or
            ``gpu`` is neither a ``ReferenceGPU`` nor a readable path to one's JSON;
            also the wrapper's own configuration errors.
        CaptureError: with ``capture``, the captured step broke a rule of CUDA stream
            capture (the message names the stream and the rule).

    Example::

        >>> report = ooo_wrap.testing.check(model, torch.randn(8, 32))
        >>> print(report)
        >>> report.raise_if_failed()
    """
    if isinstance(model, OOOModule):
        raise OOOConfigError(
            f"check() takes the plain model, but this {type(model).__name__} is wrapped; "
            "check it before wrapping, or pass ooo_wrap.unwrap(model)"
        )
    positive_int(steps, "steps")
    if capture and planner == "dataflow" and steps < 2:
        raise OOOConfigError(
            "check(capture=True) with the dataflow planner needs steps >= 2: the plan is "
            "learned on an eager first step, and only a later step can be captured"
        )
    measured = as_reference_gpu(gpu)
    backend = DetectingBackend()
    kwargs = dict(example_kwargs or {})
    model = _materialized(model, inputs, kwargs)
    wrapped = OOOModule(
        copy.deepcopy(model),
        streams,
        stages=stages,
        backend=backend,
        planner=planner,
        overlap_forward=overlap_forward,
        gpu=measured,
        split_weight_grads=split_weight_grads,
    )
    plain = copy.deepcopy(model)
    wrapped_inputs, plain_inputs = _fresh((inputs, kwargs)), _fresh((inputs, kwargs))
    with detect(backend, keep_alive=[wrapped], gpu=measured or H200) as found:
        handles = _label_stages(wrapped, found)
        try:
            checked = _train(wrapped, wrapped_inputs, loss_fn, steps, found, capture=capture)
        finally:
            for handle in handles:
                handle.remove()
    reference = _train(plain, plain_inputs, loss_fn, steps, None)
    # After training, so that what happened in the steps (a stage never called) is there.
    notes = tuple(str(event) for event in events_for(wrapped))
    version_note = torch_version_note()
    if version_note is not None:
        notes += (version_note,)
    mismatch_note = _mismatch_note(found)
    if mismatch_note is not None:
        notes += (mismatch_note,)
    records = found.ops
    return CheckReport(
        races=found.races,
        allocator_hazards=found.allocator_hazards,
        parity=_parity(checked, reference),
        ops=count_ops(records),
        trace=records,
        notes=notes,
        steps=steps,
        captured=capture,
        overlap_forward=overlap_forward,
        gpu=measured or H200,
        learning_step=1 if planner == "dataflow" else None,
        not_checked=_not_checked(
            wrapped, learned_on_last_step=planner == "dataflow" and steps == 1
        ),
    )


def torch_version_note(version: str | None = None) -> str | None:
    """A line for the report when torch (default: the installed one) is outside the
    releases the engine model was checked against (``CHECKED_TORCH``), else ``None``."""
    version = torch.__version__ if version is None else version
    (a, b), (c, d) = CHECKED_TORCH
    checked = f"the checker's autograd engine model was checked against torch {a}.{b} to {c}.{d}"
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return f"cannot read the torch version {version!r}; {checked}"
    if CHECKED_TORCH[0] <= (major, minor) <= CHECKED_TORCH[1]:
        return None
    return f"torch {version} is installed; {checked}: backward findings may not match its engine"


def _mismatch_note(found: Detection) -> str | None:
    """A line for the report if some gradient accumulated, away from its producer's
    stream, into an accumulator an older graph kept alive."""
    stale = [m for m in found.accumulator_mismatches if m.stale]
    if not stale:
        return None
    first = stale[0]
    where = f" (first: stage {first.stage})" if first.stage is not None else ""
    return (
        f"{plural(len(stale), 'gradient')} accumulated into an AccumulateGrad node an older "
        f"graph kept alive, on another stream than the one that produced "
        f"{'it' if len(stale) == 1 else 'them'}{where}: {first.producer} handed to one made "
        f"on {first.accumulator}; no race, but that stream waits for each such gradient, and "
        'torch >= 2.9 warns "The AccumulateGrad node\'s stream does not match"'
    )


def _not_checked(wrapped: nn.Module, *, learned_on_last_step: bool) -> str | None:
    """Why nothing was checked: the copy runs plain (the wrapper fell back and left it
    untouched, or learned that nothing overlaps and removed its hooks: either way no side
    stream ran), or the only step was the one that learned the plan (inline)."""
    if isinstance(wrapped, OOOModule) and not runs_plain(wrapped):
        if learned_on_last_step or wrapped.plan.pending:
            return (
                "the only step ran inline while the plan was learned, so no side stream ran "
                "and nothing was checked; pass steps >= 2"
            )
        return None
    events = events_for(wrapped)
    decisive = [e for e in events if e.kind in (EventKind.DISABLED, EventKind.SETUP_FAILED)]
    event = decisive[-1] if decisive else events[-1] if events else None
    why = f"{event.reason}: {event.message}" if event else "the model was not wrapped"
    verdict = f"the model runs plain ({why}), so no side stream ran and nothing was checked"
    if event is not None and event.reason == "no_parallelism":
        verdict += "; planner='static' (--planner static) checks the static plan instead"
    return verdict


def _materialized(model: nn.Module, inputs: tuple[Any, ...], kwargs: _Kwargs) -> nn.Module:
    """``model``, or if it has lazy parameters (``nn.LazyLinear`` before its first forward)
    a copy materialized by one no-grad forward, so both checked copies start equal."""
    lazy = (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)
    if not any(isinstance(t, lazy) for t in (*model.parameters(), *model.buffers())):
        return model
    ready = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(_SEED)
        args, fresh_kwargs = _fresh((inputs, kwargs))
        ready(*args, **fresh_kwargs)
    return ready


def _train(
    model: nn.Module,
    inputs: tuple[tuple[Any, ...], _Kwargs],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    steps: int,
    found: Detection | None,
    *,
    capture: bool = False,
) -> list[tuple[_Named, _Named]]:
    """Run the steps; per step, the outputs and gradients by name (detached). With
    ``capture`` (and ``found``), the last step runs under a simulated graph capture."""
    results = []
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    kept: list[Any] = []  # the previous step's output and loss, while the last step runs
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        for step in range(steps):
            captured = capture and step == steps - 1
            graph: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
            if found is not None and captured:
                graph = found.backend.capturing()
            with graph:
                output = model(*inputs[0], **inputs[1])
                loss = loss_fn(output) if loss_fn is not None else _default_loss(output)
                torch.autograd.backward(loss)
                grads = {name: p.grad for name, p in params if p.grad is not None}
                if found is not None:
                    # Gradients live in .grad until the next zero_grad, like parameters.
                    found.keep_alive(*grads.values())
                    with found.phase("step"):
                        _sgd(params)
                else:
                    _sgd(params)
            outputs = {name: t.detach() for name, t in named_tensors(output, "output")}
            results.append((outputs, {f"grad:{n}": g for n, g in grads.items()}))
            # Each step but the last drops its graph, so the next makes fresh nodes; the
            # one before the last keeps it alive through the last forward and backward,
            # as the usual `loss = model(x).sum(); loss.backward()` loop does (the old
            # graph then holds the parameters' accumulators). Not before a capture, which
            # is warmed up with the graph dropped.
            kept[:] = [output, loss] if step == steps - 2 and not capture else []
            del output, loss
    return results


def _sgd(params: list[tuple[str, nn.Parameter]]) -> None:
    """Read every gradient on the caller's stream and update, then zero (set to None)."""
    with torch.no_grad():
        for _, param in params:
            if param.grad is not None:
                param.add_(param.grad, alpha=-_LR)
                param.grad = None


def _default_loss(output: Any) -> torch.Tensor:
    terms = [t.sum() for _, t in named_tensors(output, "output") if t.is_floating_point()]
    terms = [t for t in terms if t.requires_grad]
    if not terms:
        raise OOOConfigError(
            "check(): the model's output has no floating-point tensor that requires grad; "
            "pass loss_fn=... that maps the output to a scalar loss"
        )
    return functools.reduce(torch.add, terms)


def _fresh(value: Any) -> Any:
    """A copy of the inputs whose tensors are new leaves, so no run touches the caller's."""
    return map_leaves(_fresh_leaf, value)


def _fresh_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return copy.deepcopy(value)


def _label_stages(model: nn.Module, found: Detection) -> list[RemovableHandle]:
    """Hooks on the copy's stages so each op is reported with the stage that ran it.

    A plan learned on the first step gets its labels as the next forward starts.
    """
    if not isinstance(model, OOOModule):
        return []
    handles: list[RemovableHandle] = []
    labelled: set[str] = set()

    def label(*_: Any) -> None:
        learned = learned_of(model.plan)
        # The stages, and the calls of branches the plan keeps on the caller's stream (no
        # stage, but their ops are named after them in the trace).
        names = [stage.name for stage in model.plan.stages]
        for region in learned.regions if learned is not None else ():
            names += [c for b in region.branches if b.stream is None for c in b.calls]
        for name in names:
            if name in labelled:
                continue
            labelled.add(name)
            try:
                module = model.get_submodule(name)
            except AttributeError:
                continue  # not a module of this model: nothing to label
            push = functools.partial(_push, found, name)
            handles.append(module.register_forward_pre_hook(push))
            pop = functools.partial(_pop, found)
            handles.append(module.register_forward_hook(pop, always_call=True))

    label()
    handles.append(model.register_forward_pre_hook(label))
    return handles


def _push(found: Detection, name: str, module: nn.Module, args: Any) -> None:
    found._push_stage(name)


def _pop(found: Detection, module: nn.Module, args: Any, output: Any) -> None:
    found._pop_stage()


def _parity(
    checked: list[tuple[_Named, _Named]], reference: list[tuple[_Named, _Named]]
) -> tuple[ParityEntry, ...]:
    worst: dict[str, float] = {}
    for (out_a, grad_a), (out_b, grad_b) in zip(checked, reference, strict=True):
        for a_side, b_side in ((out_a, out_b), (grad_a, grad_b)):
            for name in dict.fromkeys([*a_side, *b_side]):
                diff = _max_abs_diff(a_side.get(name), b_side.get(name))
                worst[name] = max(worst.get(name, 0.0), diff)
    return tuple(ParityEntry(name, diff) for name, diff in worst.items())


def _max_abs_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.layout != b.layout:
        return math.inf
    if a.layout != torch.strided:
        # Sparse gradients (nn.Embedding(sparse=True)): most comparisons below have no
        # sparse kernel, and two equal sparse tensors may hold their entries in another
        # order or uncoalesced, so compare the values they stand for.
        a, b = a.to_dense(), b.to_dense()
    if a.numel() == 0:
        return 0.0
    if torch.equal(a, b):  # the usual case, without the wide copies (NaN never equals)
        return 0.0
    if not (a.is_floating_point() or a.is_complex()):
        return math.inf
    wide = torch.complex128 if a.is_complex() else torch.float64
    a64, b64 = a.detach().to(wide), b.detach().to(wide)
    a_nan, b_nan = torch.isnan(a64), torch.isnan(b64)
    if not torch.equal(a_nan, b_nan):
        return math.inf
    same = (a64 == b64) | a_nan  # equal values, equal infinities, NaN in both
    if bool(same.all()):
        return 0.0
    return float((a64 - b64).abs().masked_fill(same, 0.0).max())
