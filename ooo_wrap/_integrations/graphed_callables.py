"""PyTorch's partial-network capture (``torch.cuda.make_graphed_callables``) of wrapped
models: the root hooks PyTorch refuses are lifted for its call and put back exactly.

Under capture a wrapped model's stages fork onto their side streams and join back as in
eager mode, so the graphs record the same multi-stream schedule and every replay runs it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, TypeVar

import torch

from .._errors import OOOConfigError
from .._wrapper.registry import (
    is_wrapped,
    let_go_of_graph,
    mark_graphed,
    plan_pending,
    race_as_graph,
    root_hooks_lifted,
    stage_of,
)

__all__ = ["make_graphed_callables"]

logger = logging.getLogger("ooo_wrap")

_T = TypeVar("_T")


def make_graphed_callables(callables: _T, sample_args: tuple[Any, ...], **kwargs: Any) -> _T:
    """``torch.cuda.make_graphed_callables`` for wrapped models too; same arguments.

    PyTorch's function refuses any module with forward hooks, and a wrapped model has
    two on its root. For each wrapped model among ``callables`` this takes the root hooks
    off for the duration of PyTorch's call and puts them back afterwards, exactly (same
    handles, same order), also when the call raises. PyTorch's warm-up and captures then
    run the stages' own hooks, which fork and join each stage call without a root call,
    so the graphs run the stages on their side streams. It also adds: a model whose plan
    is still to be learned (``dataflow`` planner, no training forward yet) first runs one
    eager forward on its sample args, on a side stream, so that its stages exist before
    the warm-up; the scheduler then expects graphed forwards to call no stage (no
    ``STAGE_NOT_CALLED`` events); a model that tunes is held plain for the capture, since
    nothing can time PyTorch's graphs (pin an arm with ``tune_arm`` to graph it, or use
    :func:`graphed_step`, which races the arms as graphs); without CUDA the callables are
    returned unchanged and an INFO log says so, so the same script runs without a GPU.

    Args:
        callables: a module or function, or a tuple of them, as PyTorch takes them.
        sample_args: a tuple of tensors, or one such tuple per callable.
        **kwargs: PyTorch's other arguments (``num_warmup_iters``,
            ``allow_unused_input``, ``pool``), passed on.

    Returns:
        What PyTorch returns (graphed callables; a module comes back with its forward
        graphed), or ``callables`` unchanged without CUDA.

    Raises:
        OOOConfigError: a callable is a stage of a wrapped model (its hooks are the
            wrapper's: pass the model, or unwrap it first).
        Exception: whatever PyTorch raises (the wrapper's hooks are back on the models by
            then), e.g. ``AssertionError`` for hooks of the caller's own on a module.

    Example::

        >>> model = ooo_wrap.OOOModule(model.cuda(), streams=4)
        >>> model = ooo_wrap.make_graphed_callables(model, (x,))
        >>> model(x).sum().backward()  # replays the forward graph, then the backward one
    """
    several = isinstance(callables, tuple)
    items: tuple[Any, ...] = callables if isinstance(callables, tuple) else (callables,)
    samples: tuple[Any, ...] = sample_args if several else (sample_args,)
    _refuse_stages(items)  # with CUDA or not: a script that runs here runs on a GPU
    if not torch.cuda.is_available():
        logger.info(
            "ooo_wrap.make_graphed_callables: no CUDA device; the callables are returned "
            "unchanged and run eagerly"
        )
        return callables
    models = list({id(item): item for item in items if is_wrapped(item)}.values())
    for item, args in zip(items, samples, strict=False):
        if is_wrapped(item) and plan_pending(item):
            _learn_plan(item, args)
    for model in models:
        # Nothing can time the graphs PyTorch captures: a tuning model (or one tuned on
        # eager steps, which do not apply to a replay) is held plain for the capture.
        tuner = race_as_graph(model)
        if tuner is not None:
            tuner.hold(tuner.arms[0])
    try:
        with contextlib.ExitStack() as lifted:
            for model in models:
                lifted.enter_context(root_hooks_lifted(model))
            # Typed by torch for modules, functions and tuples of them; _T is one of those.
            make: Any = torch.cuda.make_graphed_callables
            graphed: _T = make(callables, sample_args, **kwargs)
    except BaseException:
        for model in models:
            let_go_of_graph(model)  # nothing was graphed: they tune on eager steps again
        raise
    for model in models:
        mark_graphed(model)
    return graphed


def _refuse_stages(items: tuple[Any, ...]) -> None:
    """A stage passed alone carries the wrapper's hooks, which PyTorch refuses; say what
    to pass instead before PyTorch's less specific assertion does."""
    for index, item in enumerate(items):
        owner = stage_of(item)
        if owner is not None:
            model, name = owner
            raise OOOConfigError(
                f"callable {index} passed to make_graphed_callables is stage {name!r} of a "
                f"wrapped {type(model).__name__}, and its hooks are the wrapper's; pass the "
                "wrapped model itself, or ooo_wrap.unwrap(model) first to graph its parts"
            )


def _learn_plan(model: torch.nn.Module, args: tuple[Any, ...]) -> None:
    """One eager training forward, so the dataflow planner learns the plan (and installs
    the stages' hooks) before PyTorch's warm-up; on a side stream, as PyTorch warms up."""
    torch.cuda.synchronize()
    with torch.enable_grad(), torch.cuda.stream(torch.cuda.Stream()):  # type: ignore[no-untyped-call]
        model(*args)
    torch.cuda.synchronize()
    if plan_pending(model):
        logger.info(
            "ooo_wrap.make_graphed_callables: the plan of this %s is still to be learned "
            "(its forward did not count as a training forward): its stages run inline in "
            "the graphs",
            type(model).__name__,
        )
