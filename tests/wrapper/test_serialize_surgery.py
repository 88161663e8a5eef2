"""Copies and pickles of a wrapped model changed by surgery after wrapping (a stage
removed, moved or replaced): the model is copied as it is now, or refused with the fix."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind
from ooo_wrap.testing import SimulatedBackend
from tests.support.serialize_helpers import Towers, hook_counts, pickle_round_trip, wrapped


def _same_outputs(a: nn.Module, b: nn.Module) -> None:
    x = torch.randn(4, 8)
    torch.testing.assert_close(a(x), b(x))


def test_a_stage_removed_after_wrapping_pickles_and_is_planned_again_on_load() -> None:
    model = wrapped()  # automatic stages: towers.0, towers.1, towers.2
    del model.towers[2]
    loaded = pickle_round_trip(model)
    assert isinstance(loaded, ooo_wrap.OOOModule)
    assert [stage.name for stage in loaded.plan.stages] == ["towers.0", "towers.1"]
    assert [e.reason for e in loaded.events] == ["simulated", "unpickled"]
    _same_outputs(loaded, model)
    assert loaded.stats.stage_calls == 2


def test_a_stage_moved_after_wrapping_pickles_without_its_hooks() -> None:
    model = wrapped()
    model.head = model.towers[2]  # the stage, with the wrapper's hooks, at another name
    del model.towers[2]
    for copied in (pickle_round_trip(model), copy.deepcopy(model)):
        assert isinstance(copied, ooo_wrap.OOOModule)
        _same_outputs(copied, model)


def test_a_stage_replaced_after_wrapping_copies_the_replacement() -> None:
    model = wrapped(stages=["towers.0", "towers.1", "towers.2"])
    model.towers[1] = nn.Sequential(nn.Linear(8, 2))
    for copied in (pickle_round_trip(model), copy.deepcopy(model)):
        assert copied.plan.stages[1].name == "towers.1"
        assert len(copied.towers[1]) == 1
        _same_outputs(copied, model)


@pytest.mark.parametrize("planner", ["static", "dataflow"])
def test_stage_names_that_no_longer_fit_are_refused_naming_the_stage(planner: str) -> None:
    model = wrapped(stages=["towers.0", "towers.1", "towers.2"], planner=planner)
    del model.towers[2]
    before = hook_counts(model)
    match = r"cannot (pickle|copy) .*'towers\.2'.*ooo_wrap\.unwrap\(model\)"
    with pytest.raises(ooo_wrap.OOOError, match=match):
        pickle.dumps(model)
    with pytest.raises(ooo_wrap.OOOError, match=match):
        copy.deepcopy(model)
    assert hook_counts(model) == before  # refused: nothing of the model changed


@pytest.mark.parametrize("named", ["argument", "attribute"])
def test_a_named_stage_removed_before_the_first_forward_is_learned_without(named: str) -> None:
    # Regression: the dataflow planner looked the names up again when learning, raised
    # OOOConfigError, fell back to the static plan, which raised it again from forward.
    names = ["towers.0", "towers.1", "towers.2"]
    if named == "argument":
        model = wrapped(stages=names, planner="dataflow")
    else:
        plain = Towers()
        plain.ooo_stage_names = names
        model = ooo_wrap.OOOModule(plain, backend=SimulatedBackend())
    del model.towers[2]
    x = torch.randn(4, 8)
    model(x).sum().backward()
    assert [stage.name for stage in model.plan.stages] == ["towers.0", "towers.1"]
    assert model.plan.source == named
    (removed,) = [e for e in model.events if e.kind is EventKind.STAGE_REPLACED]
    assert removed.reason == "removed" and removed.stage == "towers.2"
    assert "the plan leaves it out" in removed.message
    assert not [e for e in model.events if e.reason == "static_fallback"]
    model(x).sum().backward()  # the learned plan runs
    assert model.stats.stage_calls == 2


@pytest.mark.parametrize("left", [0, 1])
def test_named_stages_removed_before_the_first_forward_down_to_one_stop_the_model(
    left: int,
) -> None:
    model = wrapped(stages=["towers.0", "towers.1", "towers.2"][1 - left :], planner="dataflow")
    del model.towers[2], model.towers[1]
    model(torch.randn(4, 8)).sum().backward()
    removed = [e.stage for e in model.events if e.kind is EventKind.STAGE_REPLACED]
    assert removed == ["towers.1", "towers.2"]
    assert model.events[-1].reason == "too_few_stages"
    assert model.plan.stages == ()
    model(torch.randn(4, 8)).sum().backward()
    assert model.stats.stage_calls == 0
