"""Stage resolution and stream assignment: pure functions of the model, no device work."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ._cost import GPULike, ReferenceGPU, as_reference_gpu
from ._errors import OOOConfigError, did_you_mean, positive_int

if TYPE_CHECKING:
    from ._dataflow import LearnedPlan
    from ._simulate import StepEstimate

__all__ = ["Plan", "Stage", "as_stage_names", "check_streams", "plan", "plural"]

StageSource = Literal["argument", "attribute", "automatic", "dataflow"]


@dataclass(frozen=True)
class Stage:
    """One disjoint sub-module run on a side stream.

    Attributes:
        name: dotted name of the sub-module in the model (as in ``named_modules()``).
        stream: index of the side stream it runs on, ``0 <= stream < Plan.num_streams``;
            the plan table and the race checker's report call it ``side<stream + 1>``.
        device: the device of its first parameter or buffer (else the model's).
        num_params: number of parameter elements in the stage, for display; parameters
            of a lazy module not yet run (``nn.LazyLinear``) are not counted.
    """

    name: str
    stream: int
    device: torch.device
    num_params: int

    @property
    def stream_name(self) -> str:
        """``side1`` for stream 0, ...: the name the race checker's report gives it."""
        return f"side{self.stream + 1}"


@dataclass(frozen=True)
class Plan:
    """Which sub-modules become stages and which side stream each one runs on.

    Attributes:
        stages: the stages in model order.
        max_streams: the ``streams`` asked for.
        source: where the stage names came from: the ``stages=`` argument, the model's
            ``ooo_stage_names`` attribute, automatic expansion, or the model's dataflow.
        learned: the plan learned from one observed forward (regions, estimates, edges)
            when the ``dataflow`` planner made this plan, else ``None``. A ``dataflow``
            plan without it and without stages is one still to be learned.
    """

    stages: tuple[Stage, ...]
    max_streams: int
    source: StageSource
    learned: LearnedPlan | None = field(default=None, compare=False, repr=False)

    @property
    def num_streams(self) -> int:
        """Side streams actually used: one past the highest stream index of a stage."""
        return max((stage.stream for stage in self.stages), default=-1) + 1

    @property
    def estimate(self) -> StepEstimate | None:
        """The learned plan's simulated step against one stream (the type
        ``CheckReport.estimate`` has); ``None`` for a plan never estimated."""
        return None if self.learned is None else self.learned.estimate

    @property
    def pending(self) -> bool:
        """A ``dataflow`` plan not learned yet (it is learned on the first training forward)."""
        return self.source == "dataflow" and self.learned is None and not self.stages

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The distinct devices of the stages, in stage order."""
        return tuple(dict.fromkeys(stage.device for stage in self.stages))

    def __str__(self) -> str:
        if self.pending:
            return (
                f"Plan: to be learned from the model's dataflow on its first training forward "
                f"(which runs inline on the caller's stream; max {self.max_streams} side "
                "streams); print it again after that forward"
            )
        header = (
            f"Plan: {plural(len(self.stages), 'stage')} on "
            f"{plural(self.num_streams, 'side stream')} "
            f"(max {self.max_streams}; stages from {self.source})"
        )
        rows = [("stage", "stream", "device", "params")]
        rows += [(s.name, s.stream_name, str(s.device), f"{s.num_params:,}") for s in self.stages]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [header]
        for row in rows if self.stages else []:
            cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1])]
            cells += [row[2].ljust(widths[2]), row[3].rjust(widths[3])]
            lines.append("  " + "  ".join(cells).rstrip())
        if self.learned is not None:
            lines.append(str(self.learned))
        return "\n".join(lines)


def plural(count: int, noun: str, suffix: str = "s") -> str:
    """``"1 stage"``, ``"2 stages"``; ``suffix="es"`` for ``"2 mismatches"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{suffix}"


def check_streams(streams: object, where: str = "streams") -> int:
    """Return ``streams`` if it is a positive int, else raise :class:`OOOConfigError`."""
    return positive_int(streams, where, " (the most side streams to use, e.g. 4)")


# The learned path of ``plan(..., example_inputs=...)``, registered by ``_learn`` when it is
# imported (``_wrap`` imports it), so that this module stays below the planner it feeds.
learn_from_example: (
    Callable[
        [
            nn.Module,
            int,
            Sequence[str] | None,
            Sequence[Any] | None,
            Mapping[str, Any] | None,
            ReferenceGPU | None,
        ],
        Plan,
    ]
    | None
) = None


def plan(
    model: nn.Module,
    streams: int = 4,
    *,
    stages: Sequence[str] | None = None,
    example_inputs: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    gpu: GPULike | None = None,
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

    Returns:
        The :class:`Plan`; ``print(plan)`` shows it as a table.

    Raises:
        OOOConfigError: ``model`` is not a module, ``streams`` is not a positive int,
            the names given are empty, or a stage name is unknown, repeated, the root, a
            ``ModuleList``/``ModuleDict`` (never called), or nested with another stage;
            or ``gpu`` is neither a ``ReferenceGPU`` nor a readable path to one's JSON.

    Example::

        >>> print(ooo_wrap.plan(model, streams=2))
        >>> measured = ooo_wrap.ReferenceGPU.load("reference_gpu.json")
        >>> print(ooo_wrap.plan(model, example_inputs=(x,), gpu=measured))
    """
    if not isinstance(model, nn.Module):
        raise OOOConfigError(
            f"expected a torch.nn.Module, got {type(model).__name__}; pass the model itself"
        )
    max_streams = check_streams(streams)
    reference = as_reference_gpu(gpu)
    if example_inputs is not None or example_kwargs is not None:
        assert learn_from_example is not None, "ooo_wrap._learn registers it on import"
        return learn_from_example(
            model, max_streams, stages, example_inputs, example_kwargs, reference
        )
    source: StageSource
    if stages is not None:
        names, source = as_stage_names(stages, "stages="), "argument"
    elif getattr(model, "ooo_stage_names", None) is not None:
        names = as_stage_names(model.ooo_stage_names, "model.ooo_stage_names")
        source = "attribute"
    else:
        names, source = _expand(model), "automatic"
    if source != "automatic" and not names:
        where = "stages=" if source == "argument" else "model.ooo_stage_names"
        raise OOOConfigError(
            f"{where} is empty; name at least two sub-modules, {_suggestion(model)}, "
            "or leave it out for automatic expansion"
        )
    modules = _resolve(model, names)
    fallback_device = _device_of(model) or torch.device("cpu")
    planned = tuple(
        Stage(
            name=name,
            stream=index % max_streams,
            device=_device_of(module) or fallback_device,
            num_params=_count_params(module),
        )
        for index, (name, module) in enumerate(zip(names, modules, strict=True))
    )
    return Plan(stages=planned, max_streams=max_streams, source=source)


def as_stage_names(value: object, where: str) -> list[str]:
    """Check that ``value`` is a sequence of strings (and not one bare string)."""
    if isinstance(value, str):
        raise OOOConfigError(
            f"{where} must be a sequence of dotted names, got the string {value!r}; "
            f"did you mean [{value!r}]?"
        )
    if not isinstance(value, Sequence) or not all(isinstance(n, str) for n in value):
        raise OOOConfigError(
            f"{where} must be a sequence of dotted module names, got {value!r}; "
            "pass e.g. ['encoder', 'decoder']"
        )
    return list(value)


def _has_state(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def _expand_level(module: nn.Module, prefix: str) -> list[str]:
    names: list[str] = []
    for child_name, child in module.named_children():
        if not _has_state(child):
            continue
        name = prefix + child_name
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            # Containers are never called themselves; their entries are the real stages.
            names += _expand_level(child, name + ".")
        else:
            names.append(name)
    return names


def _expand(model: nn.Module) -> list[str]:
    names = _outermost(model, _expand_level(model, ""))
    while len(names) == 1:
        inner = _outermost(model, _expand_level(model.get_submodule(names[0]), names[0] + "."))
        if not inner:
            break
        names = inner
    return names


def _outermost(model: nn.Module, names: list[str]) -> list[str]:
    """Drop candidates that lie inside another candidate or repeat an earlier one.

    A module registered under two names (T5's ``shared`` embedding is also
    ``encoder.embed_tokens``) would otherwise be a stage inside a stage. Candidates that
    merely share a sub-module (two towers over one embedding) stay separate stages, as
    tied weights do: forward joins each stage back before the next one starts, and the
    autograd engine orders the accumulation of the shared gradients.
    """
    modules = [model.get_submodule(name) for name in names]
    inside: set[int] = set()  # ids of modules strictly inside some candidate
    for module in modules:
        inside.update(id(inner) for inner in module.modules() if inner is not module)
    kept: list[str] = []
    seen: set[int] = set()
    for name, module in zip(names, modules, strict=True):
        if id(module) not in inside and id(module) not in seen:
            kept.append(name)
        seen.add(id(module))
    return kept


def _suggestion(model: nn.Module) -> str:
    names = _expand(model)
    if len(names) >= 2:
        return f"e.g. {names!r} (the automatic choice)"
    return "print(dict(model.named_modules())) lists the names"


def _resolve(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """Look up every name; reject unknown, root, container, repeated and nested stages.

    Stages may share a sub-module (like tied weights); a stage may not be, contain or lie
    inside another stage, since its hooks would then run inside that stage's.
    """
    known = {name: module for name, module in model.named_modules(remove_duplicate=False) if name}
    modules: list[nn.Module] = []
    stage_of: dict[int, str] = {}  # id of each stage module -> its stage name
    inside: dict[int, str] = {}  # id of every module strictly inside a stage -> that stage
    for name in names:
        if name == "":
            raise OOOConfigError(
                f"the root module cannot be a stage; name its sub-modules instead, "
                f"{_suggestion(model)}"
            )
        if name not in known:
            raise OOOConfigError(
                f"no submodule {name!r} in {type(model).__name__}"
                f"{did_you_mean(name, _stageable(known))} "
                "(print(dict(model.named_modules())) lists the names)"
            )
        if name in names[: len(modules)]:
            raise OOOConfigError(f"stage {name!r} is listed twice; list each stage once")
        module = known[name]
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            children = [f"{name}.{child}" for child, _ in module.named_children()]
            raise OOOConfigError(
                f"stage {name!r} is a {type(module).__name__}, which forward never calls, so "
                f"it would never run on its stream; name its entries instead: {children!r}"
            )
        if id(module) in stage_of:
            relation = f"is the same module as stage {stage_of[id(module)]!r} (registered twice)"
        elif id(module) in inside:
            relation = f"is inside stage {inside[id(module)]!r}"
        else:
            contained = [stage_of[id(m)] for m in module.modules() if id(m) in stage_of]
            relation = f"contains stage {contained[0]!r}" if contained else ""
        if relation:
            raise OOOConfigError(
                f"stage {name!r} {relation}; stages must not nest, so keep only one of them"
            )
        stage_of[id(module)] = name
        inside.update((id(m), name) for m in module.modules() if m is not module)
        modules.append(module)
    return modules


def _stageable(known: dict[str, nn.Module]) -> list[str]:
    # Suggestions must be accepted in turn: never a container forward does not call.
    return [n for n, m in known.items() if not isinstance(m, (nn.ModuleList, nn.ModuleDict))]


def _count_params(module: nn.Module) -> int:
    # A lazy module's parameters have no size until its first forward.
    return sum(
        p.numel()
        for p in module.parameters()
        if not isinstance(p, nn.parameter.UninitializedParameter)
    )


def _device_of(module: nn.Module) -> torch.device | None:
    tensor: torch.Tensor | None = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return None if tensor is None else tensor.device
