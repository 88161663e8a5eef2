"""``ooo_wrap.plan``: the one entry to planning, static or learned from example inputs."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from .._errors import OOOConfigError
from .._plan import Plan, check_streams
from .cost import H200, GPULike, ReferenceGPU, as_reference_gpu
from .dataflow import learn_plan
from .static import static_plan

__all__ = ["check_graphed", "learn_from_example", "named_stages", "plan", "reference_gpu"]


def reference_gpu(gpu: ReferenceGPU | None) -> ReferenceGPU:
    """``gpu``, or the default reference (:data:`~ooo_wrap.H200`) for ``None``."""
    return H200 if gpu is None else gpu


def plan(
    model: nn.Module,
    streams: int = 4,
    *,
    stages: Sequence[str] | None = None,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    gpu: GPULike | None = None,
    graphed: bool = False,
) -> Plan:
    """Work out the stages of ``model`` and their streams, without touching any device.

    With ``example_inputs`` (or ``example_kwargs``) this is the plan the ``dataflow``
    planner learns: one forward of a deep copy of ``model`` runs on these inputs under
    observation (on their device: the CPU, or ``meta`` for a model without data-dependent
    shapes) and the learned plan is returned, its table in ``print(plan)``. Without them
    it is the ``static`` plan, described next.

    Stage names come from ``stages`` if given, else from ``model.ooo_stage_names``, else
    from automatic expansion: parameter-free children are skipped, ``ModuleList`` and
    ``ModuleDict`` are expanded into their children, any other child is one stage, a
    candidate that lies inside another (a module registered under two names) is dropped,
    and a level that yields a single stage with children is descended into. Stages may
    share sub-modules but not nest. Streams are assigned round-robin in stage order.

    Args:
        model: the model to plan for.
        streams: the most side streams to use, a positive int.
        stages: dotted sub-module names, overriding ``ooo_stage_names`` and expansion.
        example_inputs: positional inputs of one forward: learn the plan from its dataflow.
        example_kwargs: keyword inputs of that forward.
        gpu: the reference GPU the learned plan's estimates use: an
            ``ooo_wrap.ReferenceGPU`` or the path of one's JSON (such as the one the GPU
            kit measures); ``None`` for the H200 datasheet figures. Only read when
            learning (with example inputs).
        graphed: price the learned plan's steps as a CUDA graph replay (for a step
            captured with ``ooo_wrap.graphed_step`` or ``make_graphed_callables``: no
            per-kernel launch on the host, event forks and joins as graph edges), the
            plain model's too; ``False`` prices eager launches. The table says which.
            Only read when learning.

    Returns:
        The :class:`Plan`; ``print(plan)`` shows it as a table.

    Raises:
        OOOConfigError: ``model`` is not a module, ``streams`` is not a positive int,
            the names given are empty, or a stage name is unknown, repeated, the root, a
            ``ModuleList``/``ModuleDict`` (never called), or nested with another stage;
            or ``gpu`` is neither a ``ReferenceGPU`` nor a readable path to one's JSON;
            or ``graphed`` is not a bool.

    Example::

        >>> print(ooo_wrap.plan(model, streams=2))
        >>> measured = ooo_wrap.ReferenceGPU.load("reference_gpu.json")
        >>> print(ooo_wrap.plan(model, example_inputs=(x,), gpu=measured))
        >>> print(ooo_wrap.plan(model, example_inputs=(x,), graphed=True))
    """
    if not isinstance(model, nn.Module):
        raise OOOConfigError(
            f"expected a torch.nn.Module, got {type(model).__name__}; pass the model itself"
        )
    max_streams = check_streams(streams)
    reference = as_reference_gpu(gpu)
    check_graphed(graphed, "graphed")
    if example_inputs is not None or example_kwargs is not None:
        return learn_from_example(
            model, max_streams, stages, example_inputs, example_kwargs, reference, graphed
        )
    return static_plan(model, max_streams, stages)


def check_graphed(value: object, where: str) -> bool:
    """Return ``value`` if it is a bool, else raise :class:`OOOConfigError` naming ``where``."""
    if not isinstance(value, bool):
        raise OOOConfigError(
            f"{where} must be True or False, got {value!r}; True prices the step as a CUDA "
            "graph replay (a step captured with ooo_wrap.graphed_step), False as eager launches"
        )
    return value


def named_stages(model: nn.Module, streams: int, stages: Sequence[str] | None) -> Plan | None:
    """The static plan if the user named the stages (argument or attribute), else ``None``.

    Named stages are kept as written; only their streams are learned.
    """
    static = static_plan(model, streams, stages)
    return None if static.source == "automatic" else static


def learn_from_example(
    model: nn.Module,
    streams: int,
    stages: Sequence[str] | None,
    example_inputs: Sequence[Any] | None,
    example_kwargs: Mapping[str, Any] | None,
    gpu: ReferenceGPU | None = None,
    graphed: bool = False,
) -> Plan:
    """``ooo_wrap.plan(model, example_inputs=...)``: learn on a deep copy of ``model`` (its
    forward may update buffers, such as batch-norm statistics, which the caller's must not)."""
    if type(model).__dict__.get("_ooo_dynamic", False):
        raise OOOConfigError(
            f"this {type(model).__name__} is wrapped; plan(..., example_inputs=...) takes the "
            "plain model (print(model.plan) shows a wrapped model's plan)"
        )
    named = named_stages(model, streams, stages)
    names = None if named is None else [stage.name for stage in named.stages]
    inputs = tuple(example_inputs or ())
    copied = copy.deepcopy(model)
    learned = learn_plan(
        copied,
        inputs,
        example_kwargs,
        streams=streams,
        stages=names,
        gpu=reference_gpu(gpu),
        graphed=graphed,
    )
    return learned.to_plan(model, "dataflow" if named is None else named.source)
