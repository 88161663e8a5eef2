"""Stage resolution and stream assignment: pure functions of the model, no device work."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ._errors import OOOConfigError, did_you_mean

__all__ = ["Plan", "Stage", "as_stage_names", "check_streams", "plan"]

StageSource = Literal["argument", "attribute", "automatic"]


@dataclass(frozen=True)
class Stage:
    """One disjoint sub-module run on a side stream.

    Attributes:
        name: dotted name of the sub-module in the model (as in ``named_modules()``).
        stream: index of the side stream it runs on, ``0 <= stream < Plan.num_streams``.
        device: the device of its first parameter or buffer (else the model's).
        num_params: number of parameter elements in the stage, for display.
    """

    name: str
    stream: int
    device: torch.device
    num_params: int


@dataclass(frozen=True)
class Plan:
    """Which sub-modules become stages and which side stream each one runs on.

    Attributes:
        stages: the stages in model order.
        max_streams: the ``streams`` asked for.
        source: where the stage names came from: the ``stages=`` argument, the model's
            ``ooo_stage_names`` attribute, or automatic expansion.
    """

    stages: tuple[Stage, ...]
    max_streams: int
    source: StageSource

    @property
    def num_streams(self) -> int:
        """Side streams actually used (never more than there are stages)."""
        return min(self.max_streams, len(self.stages))

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The distinct devices of the stages, in stage order."""
        return tuple(dict.fromkeys(stage.device for stage in self.stages))

    def __str__(self) -> str:
        header = (
            f"Plan: {len(self.stages)} stages on {self.num_streams} side streams "
            f"(max {self.max_streams}; stages from {self.source})"
        )
        rows = [("stage", "stream", "device", "params")]
        rows += [(s.name, str(s.stream), str(s.device), f"{s.num_params:,}") for s in self.stages]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [header]
        for row in rows:
            cells = [row[0].ljust(widths[0]), row[1].rjust(widths[1])]
            cells += [row[2].ljust(widths[2]), row[3].rjust(widths[3])]
            lines.append("  " + "  ".join(cells).rstrip())
        return "\n".join(lines)


def check_streams(streams: object, where: str = "streams") -> int:
    """Return ``streams`` if it is a positive int, else raise :class:`OOOConfigError`."""
    if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
        raise OOOConfigError(
            f"{where} must be a positive int (the most side streams to use), got {streams!r}; "
            "pass e.g. 4"
        )
    return streams


def plan(model: nn.Module, streams: int = 4, *, stages: Sequence[str] | None = None) -> Plan:
    """Work out the stages of ``model`` and their streams, without touching any device.

    Stage names come from ``stages`` if given, else from ``model.ooo_stage_names``, else
    from automatic expansion: parameter-free children are skipped, ``ModuleList`` and
    ``ModuleDict`` are expanded into their children, any other child is one stage, and a
    level that yields a single stage with children is descended into. Streams are
    assigned round-robin in stage order.

    Args:
        model: the model to plan for.
        streams: the most side streams to use, a positive int.
        stages: dotted sub-module names, overriding ``ooo_stage_names`` and expansion.

    Returns:
        The :class:`Plan`; ``print(plan)`` shows it as a table.

    Raises:
        OOOConfigError: ``model`` is not a module, ``streams`` is not a positive int, or
            a stage name is unknown, repeated, the root, or overlaps another stage.

    Example::

        >>> print(ooo_wrap.plan(model, streams=2))
    """
    if not isinstance(model, nn.Module):
        raise OOOConfigError(
            f"expected a torch.nn.Module, got {type(model).__name__}; pass the model itself"
        )
    max_streams = check_streams(streams)
    source: StageSource
    if stages is not None:
        names, source = as_stage_names(stages, "stages="), "argument"
    elif getattr(model, "ooo_stage_names", None) is not None:
        names = as_stage_names(model.ooo_stage_names, "model.ooo_stage_names")
        source = "attribute"
    else:
        names, source = _expand(model), "automatic"
    modules = _resolve(model, names)
    fallback_device = _device_of(model) or torch.device("cpu")
    planned = tuple(
        Stage(
            name=name,
            stream=index % max_streams,
            device=_device_of(module) or fallback_device,
            num_params=sum(p.numel() for p in module.parameters()),
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
    names = _expand_level(model, "")
    while len(names) == 1:
        inner = _expand_level(model.get_submodule(names[0]), names[0] + ".")
        if not inner:
            break
        names = inner
    return names


def _resolve(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """Look up every name; reject unknown, root, repeated and overlapping stages."""
    known = {name: module for name, module in model.named_modules(remove_duplicate=False) if name}
    modules: list[nn.Module] = []
    owner: dict[int, str] = {}  # id of every module inside a stage -> that stage's name
    for name in names:
        if name == "":
            raise OOOConfigError(
                "the root module cannot be a stage; name its sub-modules instead, "
                f"e.g. {list(known)[:2]!r}"
            )
        if name not in known:
            raise OOOConfigError(
                f"no submodule {name!r} in {type(model).__name__}{did_you_mean(name, known)} "
                "(print(dict(model.named_modules())) lists the names)"
            )
        if name in names[: len(modules)]:
            raise OOOConfigError(f"stage {name!r} is listed twice; list each stage once")
        module = known[name]
        for inner in module.modules():
            other = owner.get(id(inner))
            if other is None:
                continue
            if inner is module and known[other] is module:
                relation = f"is the same module as stage {other!r} (registered twice)"
            elif inner is module:
                relation = f"is inside stage {other!r}"
            else:
                relation = f"contains (part of) stage {other!r}"
            raise OOOConfigError(
                f"stage {name!r} {relation}; stages must be disjoint, so keep only one of them"
            )
        owner.update((id(inner), name) for inner in module.modules())
        modules.append(module)
    return modules


def _device_of(module: nn.Module) -> torch.device | None:
    tensor: torch.Tensor | None = next(module.parameters(), None)
    if tensor is None:
        tensor = next(module.buffers(), None)
    return None if tensor is None else tensor.device
