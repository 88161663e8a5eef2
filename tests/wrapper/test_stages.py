"""``ooo_wrap.plan``: where stages come from, how streams are assigned, and config errors."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import ooo_wrap
from ooo_wrap import OOOConfigError, Plan, Stage
from ooo_wrap.testing import SimulatedBackend
from tests.support.models import Towers, hook_snapshot


class Leafy(nn.Module):
    """``n`` linear children and no forward: enough for planning."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            self.add_module(f"l{i}", nn.Linear(2, 2))


class Encoder(nn.Module):
    def __init__(self, n_layers: int = 12) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(n_layers))
        self.norm = nn.LayerNorm(2)


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder()
        self.dec = nn.Linear(2, 2)


def names(the_plan: Plan) -> list[str]:
    return [stage.name for stage in the_plan.stages]


# --- where stage names come from ------------------------------------------------------


def test_stages_argument_wins_over_attribute_and_expansion() -> None:
    model = EncDec()
    model.ooo_stage_names = ["enc.layers.0", "enc.layers.1"]  # type: ignore[assignment]
    the_plan = ooo_wrap.plan(model, stages=["enc.norm", "dec"])
    assert names(the_plan) == ["enc.norm", "dec"]
    assert the_plan.source == "argument"


def test_ooo_stage_names_attribute_wins_over_expansion() -> None:
    class Named(EncDec):
        ooo_stage_names = ("enc.layers.3", "enc.norm", "dec")

    the_plan = ooo_wrap.plan(Named())
    assert names(the_plan) == ["enc.layers.3", "enc.norm", "dec"]
    assert the_plan.source == "attribute"


def test_ooo_stage_names_none_means_automatic() -> None:
    model = EncDec()
    model.ooo_stage_names = None  # type: ignore[assignment]
    assert ooo_wrap.plan(model).source == "automatic"


def test_ooo_stage_names_is_validated_and_named_in_the_error() -> None:
    model = EncDec()
    model.ooo_stage_names = "dec"  # type: ignore[assignment]
    with pytest.raises(OOOConfigError, match=r"model\.ooo_stage_names.*'dec'"):
        ooo_wrap.plan(model)


# --- automatic expansion ----------------------------------------------------------------


def test_parameter_free_children_are_skipped() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.1)
            self.a = nn.Linear(2, 2)
            self.act = nn.GELU()
            self.empty = nn.Sequential()
            self.b = nn.Linear(2, 2)

    the_plan = ooo_wrap.plan(Model())
    assert names(the_plan) == ["a", "b"]
    assert the_plan.source == "automatic"


def test_a_buffer_only_child_is_a_stage() -> None:
    class Stats(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("running", torch.zeros(3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stats = Stats()
            self.lin = nn.Linear(2, 2)

    assert names(ooo_wrap.plan(Model())) == ["stats", "lin"]


def test_modulelist_and_moduledict_are_expanded_recursively() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)])
            self.heads = nn.ModuleDict({"x": nn.Linear(2, 1), "y": nn.Linear(2, 1)})
            self.nested = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])])

    assert names(ooo_wrap.plan(Model())) == [
        "blocks.0",
        "blocks.2",
        "heads.x",
        "heads.y",
        "nested.0.0",
        "nested.0.1",
    ]


def test_sequential_is_one_stage() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.chain = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
            self.other = nn.Linear(2, 2)

    assert names(ooo_wrap.plan(Model())) == ["chain", "other"]


def test_a_single_stage_with_children_is_descended_into() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU()
            self.body = EncDec()

    # Wrapper -> body (the only stage) -> enc, dec.
    assert names(ooo_wrap.plan(Wrapper())) == ["body.enc", "body.dec"]


def test_descent_continues_through_several_single_stage_levels() -> None:
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    class Middle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.middle = Middle()

    assert names(ooo_wrap.plan(Outer())) == [
        "middle.inner.blocks.0",
        "middle.inner.blocks.1",
        "middle.inner.blocks.2",
    ]


def test_a_lone_sequential_is_descended_into() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))

    assert names(ooo_wrap.plan(Model())) == ["seq.0", "seq.2"]


def test_a_single_childless_stage_stays_one_stage() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.only = nn.Linear(2, 2)

    assert names(ooo_wrap.plan(Model())) == ["only"]
    assert names(ooo_wrap.plan(nn.Linear(2, 2))) == []


def test_a_module_shared_under_two_names_is_planned_once() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = self.a
            self.c = nn.Linear(2, 2)

    assert names(ooo_wrap.plan(Model())) == ["a", "c"]


# --- streams ------------------------------------------------------------------------------


def test_round_robin_streams_in_stage_order() -> None:
    the_plan = ooo_wrap.plan(Leafy(5), streams=2)
    assert [(s.name, s.stream) for s in the_plan.stages] == [
        ("l0", 0),
        ("l1", 1),
        ("l2", 0),
        ("l3", 1),
        ("l4", 0),
    ]
    assert the_plan.num_streams == 2
    assert the_plan.max_streams == 2


def test_num_streams_never_exceeds_the_stages() -> None:
    the_plan = ooo_wrap.plan(Leafy(3), streams=8)
    assert [s.stream for s in the_plan.stages] == [0, 1, 2]
    assert the_plan.num_streams == 3
    assert the_plan.max_streams == 8


@given(n_stages=st.integers(min_value=1, max_value=12), streams=st.integers(1, 6))
def test_round_robin_property(n_stages: int, streams: int) -> None:
    the_plan = ooo_wrap.plan(Leafy(n_stages), streams=streams)
    assert [s.stream for s in the_plan.stages] == [i % streams for i in range(n_stages)]
    assert the_plan.num_streams == min(streams, n_stages)
    assert {s.stream for s in the_plan.stages} == set(range(the_plan.num_streams))


def test_wrapping_creates_only_the_streams_used() -> None:
    backend = SimulatedBackend(keep_all=True)
    model = Leafy(3)
    ooo_wrap.OOOModule(model, 16, backend=backend, planner="static")
    assert [call.op for call in backend.log] == ["new_stream"] * 3


# --- the plan's data and its table ---------------------------------------------------------


def test_plan_stages_carry_device_and_params() -> None:
    the_plan = ooo_wrap.plan(EncDec(), streams=2)
    assert isinstance(the_plan.stages, tuple)
    stage = the_plan.stages[0]
    assert isinstance(stage, Stage)
    # enc: 12 x Linear(2, 2) + LayerNorm(2) = 76 parameters.
    assert stage == Stage(name="enc", stream=0, device=torch.device("cpu"), num_params=76)
    assert the_plan.stages[1] == Stage("dec", 1, torch.device("cpu"), 6)
    assert the_plan.devices == (torch.device("cpu"),)


def test_a_stage_without_state_takes_the_model_device() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = nn.ReLU()
            self.lin = nn.Linear(2, 2)

    model = Model().to("meta")
    the_plan = ooo_wrap.plan(model, stages=["act", "lin"])
    assert [s.device for s in the_plan.stages] == [torch.device("meta")] * 2
    assert [s.num_params for s in the_plan.stages] == [0, 6]


def test_plan_is_pure() -> None:
    model = Towers()
    hooks, cls, attrs = hook_snapshot(model), type(model), dict(vars(model))
    ooo_wrap.plan(model, streams=2)
    assert hook_snapshot(model) == hooks
    assert type(model) is cls
    assert vars(model) == attrs
    assert ooo_wrap.events_for(model) == ()


def test_str_plan_is_a_table_of_every_stage() -> None:
    model = Towers(n=3, dim=6)
    text = str(ooo_wrap.plan(model, streams=2))
    lines = text.splitlines()
    assert lines[0] == "Plan: 4 stages on 2 side streams (max 2; stages from automatic)"
    assert lines[1].split() == ["stage", "stream", "device", "params"]
    rows = [line.split() for line in lines[2:]]
    assert rows == [
        ["towers.0", "side1", "cpu", "110"],
        ["towers.1", "side2", "cpu", "110"],
        ["towers.2", "side1", "cpu", "110"],
        ["head", "side2", "cpu", "14"],
    ]
    # Columns line up: every row's stream column ends where the header's does.
    ends = {line.index(" cpu") for line in lines[2:]}
    assert len(ends) == 1


def test_str_plan_groups_thousands_and_names_the_source() -> None:
    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(100, 100)
            self.b = nn.Linear(2, 2)

    text = str(ooo_wrap.plan(Big(), stages=["a", "b"]))
    assert "10,100" in text
    assert "stages from argument" in text


# --- config errors -------------------------------------------------------------------------


def _config_error(model: nn.Module, **kwargs: object) -> str:
    with pytest.raises(OOOConfigError) as info:
        ooo_wrap.plan(model, **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, ooo_wrap.OOOError)
    assert isinstance(info.value, RuntimeError)
    return str(info.value)


def test_unknown_stage_name_suggests_the_closest() -> None:
    message = _config_error(EncDec(), stages=["enc.layer9", "dec"])
    assert "'enc.layer9'" in message
    assert "did you mean 'enc.layers.9'?" in message


def test_unknown_stage_name_without_a_close_match() -> None:
    message = _config_error(EncDec(), stages=["dec", "zzzzzzzz"])
    assert "'zzzzzzzz'" in message
    assert "did you mean" not in message


def test_a_parameter_name_is_not_a_stage() -> None:
    message = _config_error(EncDec(), stages=["dec.weight", "enc"])
    assert "'dec.weight'" in message


def test_duplicate_stage_name() -> None:
    message = _config_error(EncDec(), stages=["dec", "enc", "dec"])
    assert "'dec'" in message
    assert "twice" in message


def test_overlap_child_after_parent() -> None:
    message = _config_error(EncDec(), stages=["enc", "enc.layers.0"])
    assert "'enc.layers.0'" in message
    assert "inside stage 'enc'" in message


def test_overlap_parent_after_child() -> None:
    message = _config_error(EncDec(), stages=["enc.layers.0", "enc"])
    assert "stage 'enc' contains" in message
    assert "'enc.layers.0'" in message


def test_overlap_through_a_container() -> None:
    message = _config_error(EncDec(), stages=["enc.layers", "enc.layers.4"])
    assert "'enc.layers.4'" in message
    assert "'enc.layers'" in message


def test_same_module_registered_under_two_names() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = self.a

    message = _config_error(Model(), stages=["a", "b"])
    assert "'b'" in message
    assert "'a'" in message
    assert "same module" in message


def test_root_is_never_a_stage() -> None:
    message = _config_error(EncDec(), stages=["", "dec"])
    assert "root" in message


def test_bare_string_for_stages() -> None:
    message = _config_error(EncDec(), stages="enc")
    assert "stages=" in message
    assert "'enc'" in message
    assert "['enc']" in message


def test_stages_must_be_strings() -> None:
    message = _config_error(EncDec(), stages=["enc", 3])
    assert "stages=" in message
    assert "3" in message


@pytest.mark.parametrize("streams", [0, -1, True, 2.5, "4", None])
def test_streams_must_be_a_positive_int(streams: object) -> None:
    message = _config_error(EncDec(), streams=streams)
    assert "streams" in message
    assert re.search(re.escape(repr(streams)), message)


@pytest.mark.parametrize("streams", [0, -1, True, 2.5])
def test_oooModule_rejects_bad_streams_and_leaves_the_model(streams: object) -> None:
    model = Towers()
    hooks = hook_snapshot(model)
    with pytest.raises(OOOConfigError, match=re.escape(repr(streams))):
        ooo_wrap.OOOModule(model, streams, backend=SimulatedBackend(), planner="static")  # type: ignore[arg-type]
    assert type(model) is Towers
    assert hook_snapshot(model) == hooks


@pytest.mark.parametrize("not_a_module", ["model", None, 3, [nn.Linear(2, 2)]])
def test_plan_rejects_a_non_module(not_a_module: object) -> None:
    with pytest.raises(OOOConfigError, match=type(not_a_module).__name__):
        ooo_wrap.plan(not_a_module)  # type: ignore[arg-type]


def test_bad_stage_names_raise_at_wrap_time_and_leave_the_model() -> None:
    model = Towers()
    hooks = hook_snapshot(model)
    with pytest.raises(OOOConfigError, match=re.escape("did you mean 'towers.1'")):
        ooo_wrap.OOOModule(
            model, stages=["towers.0", "tower.1"], backend=SimulatedBackend(), planner="static"
        )
    assert type(model) is Towers
    assert hook_snapshot(model) == hooks
    assert ooo_wrap.events_for(model) == ()


def test_the_table_header_counts_in_the_singular_and_plural() -> None:
    one = ooo_wrap.plan(nn.Sequential(nn.Linear(2, 2)))
    assert str(one).splitlines()[0].startswith("Plan: 1 stage on 1 side stream (max 4;")
    two = ooo_wrap.plan(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), streams=1)
    assert str(two).splitlines()[0].startswith("Plan: 2 stages on 1 side stream (max 1;")
