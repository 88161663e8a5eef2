"""The static planner: stages from names (given, or automatic expansion), streams round-robin.

Pure functions of the model: no forward runs and no device is touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._errors import OOOConfigError, did_you_mean
from .._plan import Plan, Stage, StageSource, as_stage_names

__all__ = ["static_plan"]


def static_plan(model: nn.Module, max_streams: int, stages: Sequence[str] | None = None) -> Plan:
    """The plan of ``ooo_wrap.plan(model, max_streams, stages=stages)`` without example
    inputs: see that function for how the stage names are found and checked."""
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
