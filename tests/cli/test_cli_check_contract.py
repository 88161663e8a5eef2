"""``check`` against a stand-in race checker: what the CLI passes it, and its exit status.

The real checker is exercised in test_cli_check.py.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
import ooo_wrap.testing
from examples import quickstart, transformer
from ooo_wrap._cli_inputs import default_int_high, parse_shape
from tests.support.cli_factories import TokensAndFeatures
from tests.support.cli_helpers import run_cli

REAL_CHECK = ooo_wrap.testing.check
DEFAULTS = {
    "overlap_forward": False,
    "capture": False,
    "example_kwargs": None,
    "gpu": None,
    "split_weight_grads": "auto",
    "graphed": False,
    "tune_arm": None,
}


class FakeReport:
    def __init__(self, ok: bool) -> None:
        self.ok = ok

    def __str__(self) -> str:
        return "race check: 0 findings" if self.ok else "race check: 1 finding\n  details"


class FakeCheck:
    """Records its arguments; runs the model once, as a checker would."""

    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.calls: list[tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]] = []

    def __call__(self, model: nn.Module, *inputs: torch.Tensor, **options: Any) -> FakeReport:
        self.calls.append((model, inputs, options))
        model(*inputs)
        return FakeReport(self.ok)


@pytest.fixture
def fake_check(monkeypatch: pytest.MonkeyPatch) -> FakeCheck:
    fake = FakeCheck()
    monkeypatch.setattr(ooo_wrap.testing, "check", fake, raising=False)
    return fake


@pytest.mark.parametrize("ok", [True, False])
def test_check_prints_the_report_and_exits_1_on_findings(fake_check: FakeCheck, ok: bool) -> None:
    fake_check.ok = ok
    result = run_cli("check", "examples.quickstart:build_model", "--input", "8x64")
    assert result.status == (0 if ok else 1)
    assert result.out == f"{FakeReport(ok)}\n"
    assert result.err == ""


def test_check_passes_a_plain_cpu_model_inputs_and_options(fake_check: FakeCheck) -> None:
    argv = ["examples.quickstart:build_model", "--input", "8x64", "--streams", "2"]
    run_cli("check", *argv, "--stages", "towers.0", "towers.1", "--steps", "3")
    ((model, inputs, options),) = fake_check.calls
    assert type(model) is quickstart.Towers  # plain: the checker wraps it itself
    assert next(model.parameters()).device.type == "cpu"
    assert [(x.shape, x.dtype) for x in inputs] == [(torch.Size([8, 64]), torch.float32)]
    expected = {"streams": 2, "stages": ["towers.0", "towers.1"], "steps": 3}
    assert options == {**expected, "planner": "dataflow", **DEFAULTS}
    run_cli("check", "examples.quickstart:build_model", "--input", "8x64")
    assert fake_check.calls[1][2] == {
        "streams": 4,
        "stages": None,
        "steps": 2,
        "planner": "dataflow",
        **DEFAULTS,
    }


def test_check_passes_overlap_forward_and_capture(fake_check: FakeCheck) -> None:
    argv = ["check", "examples.quickstart:build_model", "--input", "8x64"]
    run_cli(*argv, "--overlap-forward")
    run_cli(*argv, "--capture")
    run_cli(*argv, "--capture", "--overlap-forward", "--planner", "static")
    passed = [call[2] for call in fake_check.calls]
    assert [(o["overlap_forward"], o["capture"]) for o in passed] == [
        (True, False),
        (False, True),
        (True, True),
    ]
    assert passed[2]["planner"] == "static"


def test_every_option_of_check_but_loss_fn_is_passed_with_its_default(
    fake_check: FakeCheck,
) -> None:
    # loss_fn is a callable: the command line cannot spell one, so it keeps its default.
    parameters = inspect.signature(REAL_CHECK).parameters
    options = {name: p.default for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert set(options) >= {"streams", "steps", "overlap_forward", "capture"}
    assert options.pop("loss_fn") is None
    run_cli("check", "examples.quickstart:build_model", "--input", "8x64")
    ((_, _, passed),) = fake_check.calls
    assert passed == options


def test_check_gets_a_plain_model_from_a_factory_that_wraps(fake_check: FakeCheck) -> None:
    assert (
        run_cli("check", "tests.support.cli_factories:already_wrapped", "--input", "2x4").status
        == 0
    )
    ((model, _, _),) = fake_check.calls
    assert type(model) is nn.Sequential


def test_check_makes_integer_inputs_valid_for_every_embedding(fake_check: FakeCheck) -> None:
    argv = ["tests.support.cli_factories:TokensAndFeatures", "--input", "64x6", "--input", "64x8"]
    assert run_cli("check", *argv, "--dtype", "int64", "float32").status == 0
    (_, (tokens, features), _), *_ = fake_check.calls
    assert (tokens.dtype, features.dtype) == (torch.int64, torch.float32)
    assert tokens.shape == (64, 6) and features.shape == (64, 8)
    assert tokens.min() >= 0 and tokens.max() < 20  # the smaller of the two tables
    assert run_cli("check", *argv, "--dtype", "int32", "float32", "--int-high", "3").status == 0
    assert fake_check.calls[-1][1][0].dtype == torch.int32
    assert set(fake_check.calls[-1][1][0].unique().tolist()) <= {0, 1, 2}


def test_check_inputs_are_seeded(fake_check: FakeCheck) -> None:
    argv = ["check", "examples.transformer:build_model", "--input", "8x32", "--dtype", "int64"]
    run_cli(*argv)
    run_cli(*argv)
    run_cli(*argv, "--seed", "1")
    first, second, other = (call[1][0] for call in fake_check.calls)
    assert torch.equal(first, second) and not torch.equal(first, other)
    assert first.max() < transformer.VOCAB


def test_check_reports_a_model_that_fails_in_one_line(fake_check: FakeCheck) -> None:
    result = run_cli("check", "examples.quickstart:build_model", "--input", "8x3")
    assert result.status == 2 and result.out == ""
    assert result.err.count("\n") == 1
    assert "the model raised RuntimeError during the check" in result.err
    assert "--input shapes" in result.err


def test_parse_shape() -> None:
    assert parse_shape("8x64") == (8, 64)
    assert parse_shape("3") == (3,)
    assert parse_shape("2x3x4") == (2, 3, 4)


def test_default_int_high() -> None:
    assert default_int_high(TokensAndFeatures()) == 20
    assert default_int_high(transformer.build_model()) == transformer.VOCAB
    assert default_int_high(quickstart.build_model()) == 2


def test_check_passes_split_weight_grads(fake_check: FakeCheck) -> None:
    argv = ["check", "examples.quickstart:build_model", "--input", "8x64"]
    for value in ("on", "off", "auto"):
        run_cli(*argv, "--split-weight-grads", value)
    passed = [call[2]["split_weight_grads"] for call in fake_check.calls]
    assert passed == [True, False, "auto"]


def test_check_passes_graphed(fake_check: FakeCheck) -> None:
    argv = ["check", "examples.quickstart:build_model", "--input", "8x64"]
    run_cli(*argv)
    run_cli(*argv, "--graphed")
    assert [call[2]["graphed"] for call in fake_check.calls] == [False, True]
