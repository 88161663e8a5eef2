"""``from_config``: the trainer-config keys, off by default, typos are errors."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind, OOOConfigError, OOOModule
from ooo_wrap.testing import SimulatedBackend
from tests.support.models import Towers, TwoTowers, hook_snapshot, make_two_towers, two_tower_input


def simulated(model: nn.Module, config: dict[Any, Any]) -> nn.Module:
    """``from_config`` with a simulated backend, as if this CPU had streams."""
    return ooo_wrap.from_config(model, config, backend=SimulatedBackend())


@pytest.mark.parametrize(
    "config",
    [{}, {"ooo_backprop": False}, {"ooo_backprop": False, "ooo_streams": 2}, {"lr": 0.1}],
)
def test_off_by_default_returns_the_model_untouched(config: dict[str, Any]) -> None:
    model = make_two_towers()
    hooks = hook_snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert simulated(model, config) is model
    assert type(model) is TwoTowers
    assert hook_snapshot(model) == hooks
    assert ooo_wrap.events_for(model) == ()


def test_on_wraps_with_the_configured_streams() -> None:
    model = Towers(n=3)
    config = {"ooo_backprop": True, "ooo_streams": 2, "ooo_planner": "static", "lr": 3e-4}
    result = simulated(model, config)
    assert result is model
    assert isinstance(model, OOOModule)
    assert model.plan.max_streams == 2
    assert model.plan.num_streams == 2
    assert [s.stream for s in model.plan.stages] == [0, 1, 0, 1]
    assert model.events[-1].kind is EventKind.ENABLED


def test_on_defaults_to_four_streams() -> None:
    model = Towers(n=5)
    simulated(model, {"ooo_backprop": True, "ooo_planner": "static"})
    assert model.plan.max_streams == 4
    assert model.plan.num_streams == 4
    model(two_tower_input(dim=6))
    assert model.stats.stage_calls == 6


def test_on_for_a_cpu_model_falls_back_with_the_reason() -> None:
    model = make_two_towers()
    assert ooo_wrap.from_config(model, {"ooo_backprop": True, "ooo_streams": 2}) is model
    assert type(model) is TwoTowers
    (event,) = ooo_wrap.events_for(model)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "cpu")


def test_compile_wins_with_a_warning() -> None:
    model = make_two_towers()
    hooks = hook_snapshot(model)
    with pytest.warns(UserWarning, match="compile"):
        result = simulated(model, {"ooo_backprop": True, "compile": True})
    assert result is model
    assert type(model) is TwoTowers
    assert hook_snapshot(model) == hooks
    (event,) = ooo_wrap.events_for(model)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "compiled")


def test_the_compile_warning_points_at_the_callers_line() -> None:
    with pytest.warns(UserWarning, match="compile") as record:
        ooo_wrap.from_config(make_two_towers(), {"ooo_backprop": True, "compile": True})
    assert [w.filename for w in record if str(w.message).startswith("ooo_wrap")] == [__file__]


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [
        ("ooo_stream", "ooo_streams"),
        ("ooo_backprob", "ooo_backprop"),
        ("ooo_back_prop", "ooo_backprop"),
    ],
)
def test_unknown_ooo_key_is_an_error_with_a_suggestion(key: str, suggestion: str) -> None:
    model = make_two_towers()
    with pytest.raises(OOOConfigError) as info:
        ooo_wrap.from_config(model, {"ooo_backprop": True, key: 2})
    message = str(info.value)
    assert repr(key) in message
    assert f"did you mean {suggestion!r}?" in message
    assert isinstance(info.value, ValueError)
    assert type(model) is TwoTowers


def test_unknown_ooo_key_is_an_error_even_when_off() -> None:
    # A typo must never silently leave the feature off.
    with pytest.raises(OOOConfigError, match="'ooo_backpropagation'"):
        ooo_wrap.from_config(make_two_towers(), {"ooo_backpropagation": True})


@pytest.mark.parametrize(
    ("config", "offender"),
    [
        ({"ooo_backprop": "yes"}, "'yes'"),
        ({"ooo_backprop": 1}, "1"),
        ({"ooo_backprop": None}, "None"),
        ({"ooo_backprop": True, "compile": "false"}, "'false'"),
        ({"ooo_backprop": True, "ooo_streams": "4"}, "'4'"),
        ({"ooo_backprop": True, "ooo_streams": 0}, "0"),
        ({"ooo_backprop": True, "ooo_streams": True}, "True"),
        ({"ooo_backprop": True, "ooo_streams": 2.5}, "2.5"),
        ({"ooo_backprop": True, "ooo_planner": "round_robin"}, "'round_robin'"),
        ({"ooo_backprop": True, "ooo_planner": None}, "None"),
    ],
)
def test_wrong_types_are_errors_naming_the_value(config: dict[str, Any], offender: str) -> None:
    model = make_two_towers()
    with pytest.raises(OOOConfigError) as info:
        simulated(model, config)
    assert f"got {offender}" in str(info.value)
    assert type(model) is TwoTowers


def test_the_planner_is_dataflow_unless_the_config_says_static() -> None:
    learning = simulated(Towers(n=3), {"ooo_backprop": True})
    assert isinstance(learning, OOOModule) and learning.plan.pending
    static = simulated(Towers(n=3), {"ooo_backprop": True, "ooo_planner": "static"})
    assert isinstance(static, OOOModule) and static.plan.source == "automatic"


def test_a_backend_is_passed_as_a_keyword() -> None:
    # The backend given is the one used.
    backend = SimulatedBackend(keep_all=True)
    config = {"ooo_backprop": True, "ooo_planner": "static"}
    model = ooo_wrap.from_config(Towers(n=3), config, backend=backend)
    assert isinstance(model, OOOModule)
    assert model.events[-1].reason == "simulated"
    model(two_tower_input(dim=6))
    assert model.stats.stage_calls == 4 and backend.log
    off = make_two_towers()
    assert ooo_wrap.from_config(off, {}, backend=backend) is off  # off: untouched
    assert type(off) is TwoTowers
    with pytest.raises(OOOConfigError, match="backend must be a stream backend"):
        ooo_wrap.from_config(make_two_towers(), {}, backend="simulated")  # type: ignore[arg-type]


def test_config_must_be_a_mapping() -> None:
    with pytest.raises(OOOConfigError, match="list"):
        ooo_wrap.from_config(make_two_towers(), [("ooo_backprop", True)])  # type: ignore[arg-type]


def test_unrelated_keys_are_ignored() -> None:
    model = make_two_towers()
    config = {
        "ooo_backprop": True,
        "lr": 1e-3,
        "optimizer": {"name": "adamw"},
        "compile_mode": "max-autotune",
        "backprop": "whatever",
        3: "non-string key",
    }
    assert simulated(model, config) is model
    assert isinstance(model, OOOModule)
