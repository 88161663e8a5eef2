"""``WrapOptions``: the wrap's keyword options as frozen, self-checking data."""

from __future__ import annotations

import pytest
from torch import nn

import ooo_wrap
from ooo_wrap._wrapper.options import WrapOptions
from ooo_wrap._wrapper.registry import wrapped as _wrapped
from ooo_wrap.testing import SimulatedBackend


def test_stage_names_are_normalised_to_a_tuple() -> None:
    assert WrapOptions(2, ["a", "b"]).stages == ("a", "b")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"streams": 0}, "streams must be a positive int"),
        ({"streams": True}, "streams must be a positive int"),
        ({"stages": "enc"}, "did you mean \\['enc'\\]"),
        ({"stages": ["enc", 3]}, "sequence of dotted module names"),
        ({"profile_ranges": "yes"}, "profile_ranges must be True or False"),
        ({"tune_cache_confirm": 1}, "tune_cache_confirm must be True or False, got 1; pass"),
    ],
)
def test_bad_options_raise_config_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ooo_wrap.OOOConfigError, match=message):
        WrapOptions(**kwargs)  # type: ignore[arg-type]


def test_the_wrap_state_keeps_the_options() -> None:
    backend = SimulatedBackend()
    model = nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    ooo_wrap.OOOModule(model, 3, stages=["b", "a"], backend=backend, profile_ranges=True)
    assert _wrapped[model].options == WrapOptions(3, ("b", "a"), backend, True)
