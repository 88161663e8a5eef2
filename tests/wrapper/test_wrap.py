"""``OOOModule`` in place: class swap, names, unwrap round trip, checkpoints, name collisions."""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind, OOOConfigError, OOOModule, Plan
from ooo_wrap.testing import SimulatedBackend
from tests.support.models import (
    Towers,
    TwoTowers,
    hook_count,
    hook_snapshot,
    make_two_towers,
    two_tower_input,
)


def wrapped_two_towers() -> TwoTowers:
    model = make_two_towers()
    assert OOOModule(model, backend=SimulatedBackend(), planner="static") is model
    return model


def attrs_of_every_module(model: nn.Module) -> dict[str, set[str]]:
    return {name: set(vars(m)) for name, m in model.named_modules(remove_duplicate=False)}


# --- the class swap -------------------------------------------------------------------------


def test_wrapping_is_in_place_with_a_swapped_class() -> None:
    model = make_two_towers()
    result = OOOModule(model, backend=SimulatedBackend(), planner="static")
    assert result is model
    assert isinstance(model, TwoTowers)
    assert isinstance(model, OOOModule)
    assert isinstance(model, nn.Module)
    # Named as the model's class (saved configs and reprs match the plain model's);
    # the qualified name says it is wrapped.
    assert type(model).__name__ == "TwoTowers"
    assert type(model).__qualname__ == "OOOTwoTowers"
    assert repr(type(model)) == f"<class '{TwoTowers.__module__}.OOOTwoTowers'>"
    assert repr(model).startswith("TwoTowers(")
    assert type(model).__mro__[1:3] == (OOOModule, TwoTowers)


def test_the_wrapped_class_is_never_pickled_as_the_original_class() -> None:
    # Pickle finds classes by __qualname__, which differs from the original's: the dynamic
    # class itself cannot be pickled (models pickle as their original class instead).
    model = wrapped_two_towers()
    with pytest.raises(pickle.PicklingError, match="OOOTwoTowers"):
        pickle.dumps(type(model))
    assert type(pickle.loads(pickle.dumps(model))).__mro__[1:3] == (OOOModule, TwoTowers)


def test_the_dynamic_class_is_cached_per_model_class() -> None:
    first, second = wrapped_two_towers(), wrapped_two_towers()
    assert type(first) is type(second)
    other = Towers()
    OOOModule(other, backend=SimulatedBackend(), planner="static")
    assert type(other) is not type(first)
    assert type(other).__qualname__ == "OOOTowers"


def test_names_and_state_dict_keys_are_unchanged() -> None:
    model = Towers()
    names = [name for name, _ in model.named_parameters()]
    buffers = [name for name, _ in model.named_buffers()]
    keys = list(model.state_dict())
    modules = [name for name, _ in model.named_modules()]
    OOOModule(model, backend=SimulatedBackend(), planner="static")
    assert [name for name, _ in model.named_parameters()] == names
    assert [name for name, _ in model.named_buffers()] == buffers
    assert list(model.state_dict()) == keys
    assert [name for name, _ in model.named_modules()] == modules
    assert not any(key.startswith(("module.", "_orig_mod.")) for key in model.state_dict())


def test_wrapping_stores_nothing_on_the_modules() -> None:
    model = Towers()
    before = attrs_of_every_module(model)
    OOOModule(model, backend=SimulatedBackend(), planner="static")
    assert attrs_of_every_module(model) == before


def test_the_wrapper_api_is_there() -> None:
    model = wrapped_two_towers()
    assert isinstance(model.plan, Plan)
    assert [stage.name for stage in model.plan.stages] == ["towers.0", "towers.1"]
    assert model.events[-1].kind is EventKind.ENABLED
    assert model.events == ooo_wrap.events_for(model)
    assert model.stats.forwards == 0
    assert isinstance(model.events, tuple)


def wrapped_sequential() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    wrapped: nn.Sequential = OOOModule(
        model, streams=2, backend=SimulatedBackend(), planner="static"
    )
    assert isinstance(wrapped, OOOModule)
    return wrapped


def test_slicing_a_wrapped_sequential_gives_a_working_plain_sequential() -> None:
    model = wrapped_sequential()
    head = model[0:2]
    assert type(head) is nn.Sequential
    assert list(head) == [model[0], model[1]]
    x = torch.randn(3, 4)
    assert torch.equal(head(x), model[1](model[0](x)))
    assert isinstance(model, OOOModule)  # the model itself stays wrapped
    assert torch.equal(model(x), ooo_wrap.unwrap(copy.deepcopy(model))(x))


@pytest.mark.parametrize(
    "args", [(), (nn.Linear(4, 4),), (nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))]
)
def test_rebuilding_through_the_class_gives_the_original_class(args: tuple[nn.Module]) -> None:
    model = wrapped_sequential()
    rebuilt = type(model)(*args)
    assert type(rebuilt) is nn.Sequential
    assert list(rebuilt) == list(args)
    assert ooo_wrap.events_for(rebuilt) == ()
    if args:
        assert rebuilt(torch.randn(2, 4)).shape[0] == 2


def test_rebuilding_a_user_class_runs_its_own_init() -> None:
    model = OOOModule(make_two_towers(), backend=SimulatedBackend(), planner="static")
    rebuilt = type(model)()
    assert type(rebuilt) is TwoTowers
    assert rebuilt(two_tower_input()).shape == model(two_tower_input()).shape


def test_rebuilding_with_bad_arguments_raises_the_original_error() -> None:
    model = wrapped_sequential()
    with pytest.raises(TypeError):
        type(model)(3)


# --- unwrap ---------------------------------------------------------------------------------


def _with_user_hooks(model: nn.Module) -> list[str]:
    """Register a mix of user hooks on the model and a stage; return the calls log."""
    calls: list[str] = []
    stage = model.get_submodule("towers.0")
    model.register_forward_hook(lambda m, a, o: calls.append("root-post") or None)
    model.register_forward_pre_hook(lambda m, a: calls.append("root-pre") or None)
    stage.register_forward_pre_hook(
        lambda m, a, k: calls.append("stage-pre-kw") or None, with_kwargs=True
    )
    stage.register_forward_hook(
        lambda m, a, k, o: calls.append("stage-post-always") or None,
        with_kwargs=True,
        always_call=True,
    )
    return calls


def test_unwrap_restores_class_hooks_and_names_exactly() -> None:
    model = make_two_towers()
    _with_user_hooks(model)
    hooks = hook_snapshot(model)
    keys = list(model.state_dict())
    attrs = attrs_of_every_module(model)
    count = hook_count(model)

    OOOModule(model, backend=SimulatedBackend(), planner="static")
    assert hook_count(model) == count + 6  # root pre/post and two per stage
    model(two_tower_input())
    result = model.unwrap()

    assert result is model
    assert type(model) is TwoTowers
    assert not isinstance(model, OOOModule)
    assert hook_snapshot(model) == hooks
    assert list(model.state_dict()) == keys
    assert attrs_of_every_module(model) == attrs
    assert not hasattr(model, "unwrap")
    assert ooo_wrap.events_for(model)[-1].kind is EventKind.UNWRAPPED


def test_unwrap_is_idempotent_and_a_no_op_on_plain_models() -> None:
    model = wrapped_two_towers()
    model.unwrap()
    hooks = hook_snapshot(model)
    events = ooo_wrap.events_for(model)
    assert ooo_wrap.unwrap(model) is model
    assert ooo_wrap.unwrap(model) is model
    assert type(model) is TwoTowers
    assert hook_snapshot(model) == hooks
    assert ooo_wrap.events_for(model) == events

    plain = make_two_towers()
    hooks = hook_snapshot(plain)
    assert ooo_wrap.unwrap(plain) is plain
    assert type(plain) is TwoTowers
    assert hook_snapshot(plain) == hooks
    assert ooo_wrap.events_for(plain) == ()


@pytest.mark.parametrize("state", ["learning", "no_parallelism", "static", "fell_back"])
def test_ooo_wrap_unwrap_is_idempotent_in_every_state(state: str) -> None:
    chain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model = chain if state == "no_parallelism" else make_two_towers()
    cls, hooks = type(model), hook_snapshot(model)
    planner = "static" if state == "static" else "dataflow"
    backend = None if state == "fell_back" else SimulatedBackend()
    OOOModule(model, backend=backend, planner=planner)
    if state == "no_parallelism":
        model(torch.randn(2, 4))  # learns that nothing overlaps: every hook removed
        assert ooo_wrap.events_for(model)[-1].reason == "no_parallelism"
    for _ in range(3):
        assert ooo_wrap.unwrap(model) is model
        assert type(model) is cls and hook_snapshot(model) == hooks
    # The method is the wrapper's: the plain model has none (unwrap restores it exactly).
    assert not hasattr(model, "unwrap")


def test_unwrapped_model_runs_plain_and_can_be_wrapped_again() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = make_two_towers()
    OOOModule(model, backend=backend, planner="static")
    model.unwrap()
    backend.clear_log()
    model(two_tower_input())
    assert backend.log == ()
    OOOModule(model, streams=1, backend=backend, planner="static")
    assert model.plan.num_streams == 1
    model(two_tower_input())
    assert model.stats.stage_calls == 2


def test_user_hooks_registered_before_and_after_wrapping_still_run() -> None:
    model = make_two_towers()
    calls = _with_user_hooks(model)
    OOOModule(model, backend=SimulatedBackend(), planner="static")
    stage = model.get_submodule("towers.1")
    stage.register_forward_hook(lambda m, a, o: calls.append("after-wrap") or None)
    model(two_tower_input())
    assert calls == ["root-pre", "stage-pre-kw", "stage-post-always", "after-wrap", "root-post"]
    assert model.stats.stage_calls == 2

    calls.clear()
    model.unwrap()
    model(two_tower_input())
    assert calls == ["root-pre", "stage-pre-kw", "stage-post-always", "after-wrap", "root-post"]


# --- checkpoints ----------------------------------------------------------------------------


def test_checkpoint_saved_wrapped_loads_plain_and_back(tmp_path: Path) -> None:
    wrapped = wrapped_two_towers()
    with torch.no_grad():
        for p in wrapped.parameters():
            p.add_(1.0)
    path = tmp_path / "wrapped.pt"
    torch.save(wrapped.state_dict(), path)

    plain = TwoTowers()
    plain.load_state_dict(torch.load(path, weights_only=True))
    for key, value in wrapped.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    x = two_tower_input()
    assert torch.equal(plain(x), wrapped(x))

    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(2.0)
    back = tmp_path / "plain.pt"
    torch.save(plain.state_dict(), back)
    other = wrapped_two_towers()
    other.load_state_dict(torch.load(back, weights_only=True))
    assert torch.equal(other(x), plain(x))
    assert isinstance(other, OOOModule)


# --- errors ---------------------------------------------------------------------------------


def test_wrapping_twice_is_an_error() -> None:
    model = wrapped_two_towers()
    hooks = hook_snapshot(model)
    with pytest.raises(OOOConfigError, match="already wrapped") as info:
        OOOModule(model, backend=SimulatedBackend(), planner="static")
    assert "TwoTowers" in str(info.value)
    assert hook_snapshot(model) == hooks
    assert type(model).__qualname__ == "OOOTwoTowers"


@pytest.mark.parametrize("value", [None, "model", 3, [nn.Linear(2, 2)]])
def test_wrapping_a_non_module_is_an_error(value: Any) -> None:
    with pytest.raises(OOOConfigError, match=type(value).__name__) as info:
        OOOModule(value, backend=SimulatedBackend(), planner="static")
    assert isinstance(info.value, ValueError)


def test_subclassing_oooModule_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="OOOModule"):

        class Mine(OOOModule):
            pass


def test_api_on_a_model_that_is_not_wrapped_is_an_error() -> None:
    model = wrapped_two_towers()
    model.unwrap()
    with pytest.raises(OOOConfigError, match="not wrapped"):
        OOOModule.plan.fget(model)  # type: ignore[attr-defined]


# --- names the model already has ------------------------------------------------------------


def test_a_model_method_named_plan_stays_the_models() -> None:
    class Planner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def plan(self) -> str:
            return "the model's own plan"

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.a(x) + self.b(x)
            return out

    model = Planner()
    with pytest.warns(UserWarning, match=r"'plan'.*events_for") as record:
        OOOModule(model, backend=SimulatedBackend(), planner="static")
    assert [w.filename for w in record if str(w.message).startswith("ooo_wrap")] == [__file__]
    assert isinstance(model, OOOModule)
    assert model.plan() == "the model's own plan"
    the_plan = OOOModule.plan.fget(model)  # type: ignore[attr-defined]
    assert isinstance(the_plan, Plan)
    assert [stage.name for stage in the_plan.stages] == ["a", "b"]
    assert ooo_wrap.events_for(model)[-1].kind is EventKind.ENABLED
    model(torch.randn(2, 4))
    assert model.stats.stage_calls == 2  # not shadowed: still the wrapper's

    # Warned once per class, not per model.
    another = Planner()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OOOModule(another, backend=SimulatedBackend(), planner="static")
    assert type(another) is type(model)
    assert model.unwrap() is model
    assert type(model) is Planner
    assert model.plan() == "the model's own plan"


def test_a_submodule_named_events_and_an_attribute_named_stats_stay_the_models() -> None:
    class Busy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.events = nn.Linear(4, 4)
            self.other = nn.Linear(4, 4)
            self.stats = {"calls": 0}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.stats["calls"] += 1
            out: torch.Tensor = self.events(x) + self.other(x)
            return out

    model = Busy()
    submodule = model.events
    with pytest.warns(UserWarning) as record:
        OOOModule(model, backend=SimulatedBackend(), planner="static")
    messages = " ".join(str(w.message) for w in record)
    assert "'events'" in messages
    assert "'stats'" in messages
    assert isinstance(model, OOOModule)
    assert model.events is submodule
    assert model.stats == {"calls": 0}
    model(torch.randn(2, 4))
    assert model.stats == {"calls": 1}
    events = ooo_wrap.events_for(model)
    assert [event.kind for event in events] == [EventKind.ENABLED]
    wrapper_stats = OOOModule.stats.fget(model)  # type: ignore[attr-defined]
    assert wrapper_stats.stage_calls == 2
    assert [s.name for s in model.plan.stages] == ["events", "other"]
    assert list(model.state_dict()) == [
        "events.weight",
        "events.bias",
        "other.weight",
        "other.bias",
    ]
    model.stats = {"calls": 10}  # still assignable: it is the model's attribute
    assert model.stats == {"calls": 10}
    assert model.unwrap() is model
    assert model.events is submodule


def test_the_enabled_event_counts_in_the_singular() -> None:
    model = OOOModule(make_two_towers(), streams=1, backend=SimulatedBackend(), planner="static")
    assert model.events[0].message.startswith("2 stages on 1 side stream (cpu,")
