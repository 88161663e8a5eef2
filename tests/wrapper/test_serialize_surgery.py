"""Copies and pickles of a wrapped model changed by surgery after wrapping (a stage
removed, moved or replaced): the model is copied as it is now, or refused with the fix."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import ooo_wrap
from tests.support.serialize_helpers import hook_counts, pickle_round_trip, wrapped


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
