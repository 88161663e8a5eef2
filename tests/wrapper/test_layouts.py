"""Real model layouts plan, wrap and check cleanly, or fail with a config error that helps.

Modules registered under two names, lazy modules, containers named as stages, stages a
forward never calls, and options that are not what they claim to be.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind, OOOConfigError, OOOModule
from ooo_wrap.testing import SimulatedBackend, check
from tests.support.cli_factories import SharedEmbeddingTowers, T5Style
from tests.support.models import Towers, hook_snapshot


def names(model: nn.Module, **kwargs: object) -> list[str]:
    return [stage.name for stage in ooo_wrap.plan(model, **kwargs).stages]  # type: ignore[arg-type]


def tokens() -> torch.Tensor:
    return torch.randint(0, 16, (4, 5))


# --- a module registered under two names ---------------------------------------------------


def test_towers_sharing_an_embedding_are_two_stages() -> None:
    # The root-level alias lies inside both towers: dropped; the towers share it like a
    # tied weight and stay separate stages.
    assert names(SharedEmbeddingTowers()) == ["left", "right"]


def test_a_root_module_aliased_inside_a_child_is_not_a_stage() -> None:
    assert names(T5Style()) == ["encoder", "decoder"]


def test_a_module_registered_twice_in_one_container_is_one_stage() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
            self.alias = self.blocks[0]

    assert names(Twice()) == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize("factory", [SharedEmbeddingTowers, T5Style])
def test_shared_layouts_wrap_train_and_check_clean(factory: type[nn.Module]) -> None:
    model = OOOModule(factory(), streams=2, backend=SimulatedBackend(), planner="static")
    assert isinstance(model, OOOModule)
    model(tokens()).sum().backward()
    assert model.stats.stage_calls == 2
    report = check(factory(), tokens(), planner="static")
    assert report.ok, str(report)
    assert report.not_checked is None


def test_user_named_towers_may_share_a_sub_module() -> None:
    assert names(SharedEmbeddingTowers(), stages=["right", "left"]) == ["right", "left"]


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (["shared", "encoder.embed_tokens"], "same module as stage 'shared'"),
        (["encoder", "shared"], "is inside stage 'encoder'"),
        (["shared", "decoder"], "stage 'decoder' contains stage 'shared'"),
    ],
)
def test_user_named_nested_stages_are_refused(stages: list[str], message: str) -> None:
    with pytest.raises(OOOConfigError, match=message):
        ooo_wrap.plan(T5Style(), stages=stages)


def test_the_root_stage_error_suggests_a_plan_that_is_accepted() -> None:
    class Trunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.trunk = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    with pytest.raises(OOOConfigError, match="root") as info:
        ooo_wrap.plan(Trunk(), stages=[""])
    assert "['trunk.0', 'trunk.1']" in str(info.value)
    assert names(Trunk(), stages=["trunk.0", "trunk.1"]) == ["trunk.0", "trunk.1"]


# --- devices before planning ---------------------------------------------------------------


def test_a_cpu_model_falls_back_for_the_cpu_before_any_planning() -> None:
    class Named(nn.Module):
        ooo_stage_names = ("no_such_module", "nor_this")

        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

    model = Named()
    hooks = hook_snapshot(model)
    assert OOOModule(model, planner="static") is model
    assert type(model) is Named and hook_snapshot(model) == hooks
    assert [(e.kind, e.reason) for e in ooo_wrap.events_for(model)] == [(EventKind.DISABLED, "cpu")]


# --- lazy modules ----------------------------------------------------------------------------


def lazy() -> nn.Module:
    return nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.LazyLinear(3))


def test_lazy_parameters_plan_wrap_and_check() -> None:
    the_plan = ooo_wrap.plan(lazy())
    assert [(s.name, s.num_params) for s in the_plan.stages] == [("0", 0), ("2", 0)]
    model = OOOModule(lazy(), backend=SimulatedBackend(), planner="static")
    assert isinstance(model, OOOModule)
    model(torch.randn(2, 5)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    report = check(lazy(), torch.randn(2, 5), planner="static")
    assert report.ok, str(report)


# --- stages that are never called ----------------------------------------------------------


class Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.heads = nn.ModuleDict({"a": nn.Linear(2, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.heads["a"](x)


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        (["layers", "heads.a"], r"'layers' is a ModuleList.*\['layers.0', 'layers.1'\]"),
        (["layers.0", "heads"], r"'heads' is a ModuleDict.*\['heads.a'\]"),
    ],
)
def test_a_named_container_is_a_config_error_suggesting_its_entries(
    stages: list[str], message: str
) -> None:
    with pytest.raises(OOOConfigError, match=message):
        ooo_wrap.plan(Layers(), stages=stages)


def test_a_misspelled_name_is_never_answered_with_a_container() -> None:
    with pytest.raises(OOOConfigError) as info:
        ooo_wrap.plan(Layers(), stages=["layer", "heads.a"])
    assert "did you mean 'layers'" not in str(info.value)


class Grouped(nn.Module):
    """``group`` only holds ``inner``; forward calls ``inner`` directly, never ``group``."""

    def __init__(self) -> None:
        super().__init__()
        self.group = nn.Module()
        self.group.inner = nn.Linear(2, 2)
        self.head = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.group.inner(x))


def test_a_stage_never_called_is_reported_once_after_the_forward(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = OOOModule(Grouped(), backend=SimulatedBackend(), planner="static")
    assert [s.name for s in model.plan.stages] == ["group", "head"]
    x = torch.randn(3, 2)
    with caplog.at_level(logging.WARNING, logger="ooo_wrap"):
        model(x)
        model(x)
    reports = [e for e in model.events if e.kind is EventKind.STAGE_NOT_CALLED]
    assert [(e.reason, e.stage, e.count) for e in reports] == [("not_called", "group", 1)]
    logged = [r for r in caplog.records if "stage_not_called" in r.getMessage()]
    assert len(logged) == 1
    assert "[group]" in logged[0].getMessage()


def test_check_notes_a_stage_never_called() -> None:
    report = check(Grouped(), torch.randn(3, 2), planner="static")
    assert any(note.startswith("stage_not_called/not_called [group]") for note in report.notes)


@pytest.mark.parametrize("surgery", ["replaced", "removed"])
def test_a_stage_replaced_or_removed_after_wrapping_is_reported_as_such(surgery: str) -> None:
    model = OOOModule(Towers(n=3), backend=SimulatedBackend(), planner="static")
    assert [s.name for s in model.plan.stages] == ["towers.0", "towers.1", "towers.2", "head"]
    calls: list[str] = []
    if surgery == "replaced":
        model.towers[1] = nn.Linear(6, 6)
        model.towers[1].register_forward_hook(lambda *_: calls.append("new") or None)
    else:
        del model.towers[2]
    changed = "towers.1" if surgery == "replaced" else "towers.2"
    model(torch.randn(3, 6))
    model(torch.randn(3, 6))
    assert model.stats.stage_calls == 2 * 3
    assert calls == (["new", "new"] if surgery == "replaced" else [])
    kinds = {e.kind for e in model.events}
    assert EventKind.STAGE_NOT_CALLED not in kinds
    (event,) = [e for e in model.events if e.kind is EventKind.STAGE_REPLACED]
    assert (event.reason, event.stage, event.count) == (surgery, changed, 1)
    assert f"'{changed}'" in event.message and "after wrapping" in event.message
    if surgery == "replaced":
        assert "runs inline on the caller's stream" in event.message
    assert "model.replan()" in event.message


def test_every_stage_called_reports_nothing() -> None:
    model = OOOModule(
        Grouped(), stages=["group.inner", "head"], backend=SimulatedBackend(), planner="static"
    )
    model(torch.randn(3, 2))
    assert not any(e.kind is EventKind.STAGE_NOT_CALLED for e in model.events)


def test_a_forward_that_raises_or_runs_inline_reports_nothing() -> None:
    model = OOOModule(
        Grouped(), stages=["group.inner", "head"], backend=SimulatedBackend(), planner="static"
    )
    with pytest.raises(RuntimeError):
        model(torch.randn(3, 5))  # group.inner raises: head is not reached
    with ooo_wrap.disabled():
        model(torch.randn(3, 2))
    assert not any(e.kind is EventKind.STAGE_NOT_CALLED for e in model.events)


# --- options that are not what they claim --------------------------------------------------


@pytest.mark.parametrize("where", ["argument", "attribute"])
def test_empty_stages_is_a_config_error(where: str) -> None:
    model = Layers()
    if where == "attribute":
        model.ooo_stage_names = []  # type: ignore[assignment]
        kwargs = {}
    else:
        kwargs = {"stages": []}
    with pytest.raises(OOOConfigError, match="is empty") as info:
        ooo_wrap.plan(model, **kwargs)  # type: ignore[arg-type]
    assert "['layers.0', 'layers.1', 'heads.a']" in str(info.value)


# ids spelled out: a test id containing "cuda" would be skipped as a GPU test.
@pytest.mark.parametrize(
    "backend", ["accelerator", torch.device("meta"), object()], ids=["str", "device", "object"]
)
def test_a_backend_that_is_not_a_backend_is_a_config_error(backend: object) -> None:
    model = Layers()
    hooks = hook_snapshot(model)
    with pytest.raises(OOOConfigError, match="backend must be a stream backend") as info:
        OOOModule(model, backend=backend, planner="static")  # type: ignore[arg-type]
    assert type(backend).__name__ in str(info.value)
    assert type(model) is Layers and hook_snapshot(model) == hooks
