"""The fallback table: every row leaves a model that trains, and says why."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import EventKind, OOOEvent, OOOModule
from ooo_wrap._runtime.backend import AcceleratorBackend
from ooo_wrap._tensors import tensors_in
from ooo_wrap.testing import SimulatedBackend, VirtualStream
from tests.support.models import (
    Scriptable,
    Towers,
    TwoTowers,
    hook_count,
    hook_snapshot,
    loss_of,
    make_two_towers,
    two_tower_input,
)

# torch.compile and torch.jit.script emit TorchScript deprecation notices of their own.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")


def only_event(model: Any) -> OOOEvent:
    (event,) = ooo_wrap.events_for(model)
    return event


def assert_untouched(model: nn.Module, cls: type[nn.Module], hooks: dict[str, Any]) -> None:
    assert type(model) is cls
    assert not isinstance(model, OOOModule)
    assert hook_snapshot(model) == hooks


def assert_trains_like(model: nn.Module, plain: nn.Module, x: torch.Tensor) -> None:
    """Forward and backward give bitwise the plain model's outputs and gradients."""
    out, want = model(x), plain(x)
    for a, b in zip(tensors_in(out), tensors_in(want), strict=True):
        assert torch.equal(a, b)
    loss_of(out).backward()
    loss_of(want).backward()
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad), name


# --- devices ----------------------------------------------------------------------------------


def test_accelerator_backend_reasons() -> None:
    backend = AcceleratorBackend()
    assert backend.unsupported_reason(torch.device("cpu")) == "cpu"
    assert backend.unsupported_reason(torch.device("mps")) == "mps"
    assert backend.unsupported_reason(torch.device("meta")) == "no_accelerator"
    if not torch.accelerator.is_available():
        assert backend.unsupported_reason(torch.device("cuda")) == "no_accelerator"


def test_cpu_model_with_the_default_backend_is_untouched() -> None:
    model = Towers()
    plain = copy.deepcopy(model)
    hooks = hook_snapshot(model)
    assert hook_count(model) == 0

    assert OOOModule(model, streams=2, planner="static") is model

    assert_untouched(model, Towers, hooks)
    assert hook_count(model) == 0
    event = only_event(model)
    assert event.kind is EventKind.DISABLED
    assert event.reason == "cpu"
    assert "CPU" in event.message
    assert_trains_like(model, plain, torch.randn(3, 6))


def test_model_on_a_device_without_streams_is_untouched() -> None:
    model = Towers().to("meta")
    hooks = hook_snapshot(model)
    assert OOOModule(model, planner="static") is model
    assert_untouched(model, Towers, hooks)
    event = only_event(model)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "no_accelerator")


def test_stages_on_two_devices_are_untouched() -> None:
    model = make_two_towers()
    model.towers[1].to("meta")  # model parallel: one tower elsewhere
    hooks = hook_snapshot(model)
    assert OOOModule(model, backend=SimulatedBackend(), planner="static") is model
    assert_untouched(model, TwoTowers, hooks)
    event = only_event(model)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "multi_device")
    assert "several devices" in event.message


@pytest.mark.parametrize(
    ("model", "stages"),
    [
        (nn.Linear(4, 4), None),  # no children: no stage
        (nn.Sequential(nn.Linear(4, 4)), None),  # one childless stage
        (make_two_towers(), ["towers.0"]),  # one stage named
    ],
    ids=["leaf", "one_stage", "one_named"],
)
def test_fewer_than_two_stages_is_untouched(model: nn.Module, stages: list[str] | None) -> None:
    cls, hooks = type(model), hook_snapshot(model)
    backend = SimulatedBackend(keep_all=True)
    assert OOOModule(model, backend=backend, stages=stages, planner="static") is model
    assert_untouched(model, cls, hooks)
    event = only_event(model)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "too_few_stages")
    assert "stages=" in event.message
    assert backend.log == ()  # no stream created


class NamesOneStage(TwoTowers):
    ooo_stage_names = ("towers.1",)


@pytest.mark.parametrize("planner", ["static", "dataflow"])
@pytest.mark.parametrize("where", ["stages=", "model.ooo_stage_names"])
def test_a_single_named_stage_says_it_has_nothing_to_overlap_with(planner: str, where: str) -> None:
    model = make_two_towers() if where == "stages=" else NamesOneStage()
    stages = ["towers.0"] if where == "stages=" else None
    name = "towers.0" if where == "stages=" else "towers.1"
    cls, hooks = type(model), hook_snapshot(model)
    OOOModule(model, backend=SimulatedBackend(), stages=stages, planner=planner)  # type: ignore[arg-type]
    assert_untouched(model, cls, hooks)
    event = only_event(model)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "too_few_stages")
    assert event.message.startswith(
        f"{where} names a single stage, {name!r}, which has nothing to overlap with"
    )
    assert "name stages with" not in event.message  # the user did
    assert "two or more" in event.message


class Stateless(nn.Module):
    """Two sub-modules, neither with a parameter or a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.ReLU(), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) * self.right(x)


@pytest.mark.parametrize("tune", [True, "auto", False])
@pytest.mark.parametrize("planner", ["static", "dataflow"])
@pytest.mark.parametrize("stages", [None, ["left", "right"]], ids=["automatic", "named"])
@pytest.mark.parametrize("backend", ["simulated", "timed", "accelerator"])
def test_a_model_without_parameters_or_buffers_falls_back_whatever_the_options(
    tune: Any, planner: str, stages: list[str] | None, backend: str
) -> None:
    # It has no device to put side streams on (nor to time steps on, with tune=True).
    backends = {
        "simulated": SimulatedBackend(),
        "timed": SimulatedBackend(step_time=lambda step: 1.0),
        "accelerator": None,
    }
    model = Stateless()
    hooks = hook_snapshot(model)
    wrapped = OOOModule(model, backend=backends[backend], tune=tune, planner=planner, stages=stages)
    assert wrapped is model
    assert_untouched(model, Stateless, hooks)
    event = only_event(model)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "too_few_stages")
    assert event.message.startswith("the model has neither parameters nor buffers")
    x = torch.randn(3, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None


def test_fallback_is_logged_at_info_on_the_ooo_wrap_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="ooo_wrap"):
        OOOModule(Towers(), planner="static")
    records = [r for r in caplog.records if r.name == "ooo_wrap"]
    assert len(records) == 1
    assert records[0].levelno == logging.INFO
    assert "disabled/cpu" in records[0].getMessage()


@pytest.fixture
def accelerator_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend a CUDA accelerator is there (the model itself stays on the CPU)."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))


@pytest.mark.usefixtures("accelerator_available")
def test_wrapping_on_the_cpu_next_to_an_accelerator_warns_naming_the_fix() -> None:
    model = Towers()
    with pytest.warns(UserWarning, match=r"move it first, then wrap") as caught:
        assert OOOModule(model, streams=2, planner="static") is model
    (warning,) = caught
    assert "cuda accelerator is available" in str(warning.message)
    assert "OOOModule(model.to('cuda'), ...)" in str(warning.message)
    assert warning.filename == __file__  # attributed to the caller's line
    assert only_event(model).reason == "cpu"


@pytest.mark.usefixtures("accelerator_available")
def test_the_cpu_warning_follows_the_warnings_filters() -> None:
    """Python's own once-per-line registry, not a flag of the library: under the default
    filter a loop that wraps many models warns once; under "always" every wrap warns."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            OOOModule(Towers(), planner="static")
    assert [str(w.message).count("move it first") for w in caught] == [1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            OOOModule(Towers(), planner="static")
    assert len(caught) == 2
    assert all(w.filename == __file__ for w in caught)


@pytest.mark.usefixtures("accelerator_available")
def test_no_warning_with_a_backend_given_or_for_other_reasons() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OOOModule(
            nn.Sequential(nn.Linear(4, 4)), backend=SimulatedBackend(), planner="static"
        )  # too_few
        OOOModule(Towers().to("meta"), planner="static")  # no_accelerator


def test_wrapping_on_the_cpu_without_an_accelerator_stays_quiet(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="ooo_wrap"):
        warnings.simplefilter("error")
        OOOModule(Towers(), planner="static")
    assert [r.levelno for r in caplog.records if r.name == "ooo_wrap"] == [logging.INFO]


def test_enabled_is_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ooo_wrap"):
        OOOModule(make_two_towers(), backend=SimulatedBackend(), planner="static")
    (record,) = [r for r in caplog.records if r.name == "ooo_wrap"]
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith("enabled/simulated")


def test_runtime_events_are_logged_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    model = make_two_towers()
    OOOModule(model, backend=SimulatedBackend(), planner="static")
    with caplog.at_level(logging.INFO, logger="ooo_wrap"), ooo_wrap.disabled():
        for _ in range(5):
            model(two_tower_input())
    (record,) = [r for r in caplog.records if r.name == "ooo_wrap"]
    assert "bypassed/disabled" in record.getMessage()


def test_a_fallback_never_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OOOModule(Towers(), planner="static")
        OOOModule(nn.Linear(2, 2), backend=SimulatedBackend(), planner="static")


# --- setup failures ---------------------------------------------------------------------------


class NoStreamsBackend(SimulatedBackend):
    def new_stream(self, device: torch.device) -> VirtualStream:
        raise RuntimeError("no streams today")


def test_stream_creation_failure_leaves_the_model_training() -> None:
    model = make_two_towers()
    plain = copy.deepcopy(model)
    hooks = hook_snapshot(model)
    with pytest.warns(UserWarning, match="setup failed"):
        assert OOOModule(model, backend=NoStreamsBackend(), planner="static") is model
    assert_untouched(model, TwoTowers, hooks)
    event = only_event(model)
    assert event.kind is EventKind.SETUP_FAILED
    assert event.reason == "RuntimeError"
    assert "no streams today" in event.message
    assert_trains_like(model, plain, two_tower_input())


def test_hook_registration_failure_removes_every_hook(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = make_two_towers()
    plain = copy.deepcopy(model)
    user_calls: list[str] = []
    model.register_forward_hook(lambda m, a, o: user_calls.append("user") or None)
    hooks = hook_snapshot(model)
    attrs = {name: set(vars(m)) for name, m in model.named_modules()}
    hooks_when_failing: list[int] = []
    last_stage = model.get_submodule("towers.1")

    def fail(*args: object, **kwargs: object) -> None:
        hooks_when_failing.append(hook_count(model))
        raise RuntimeError("hook registration refused")

    monkeypatch.setattr(last_stage, "register_forward_hook", fail)
    with caplog.at_level(logging.WARNING, logger="ooo_wrap"), pytest.warns(UserWarning):
        assert OOOModule(model, backend=SimulatedBackend(), planner="static") is model
    monkeypatch.undo()
    vars(last_stage).pop("register_forward_hook", None)  # undo() leaves the method there

    # Root pre/post, towers.0 pre/post and towers.1 pre were in place when it failed.
    assert hooks_when_failing == [1 + 5]
    assert_untouched(model, TwoTowers, hooks)
    assert {name: set(vars(m)) for name, m in model.named_modules()} == attrs
    event = only_event(model)
    assert (event.kind, event.reason) == (EventKind.SETUP_FAILED, "RuntimeError")
    assert "hook registration refused" in event.message
    assert any(r.levelno == logging.WARNING for r in caplog.records if r.name == "ooo_wrap")
    assert_trains_like(model, plain, two_tower_input())
    assert user_calls == ["user"]

    # Nothing is left half-wrapped: the model can be wrapped for real now.
    OOOModule(model, backend=SimulatedBackend(), planner="static")
    assert model.events[-1].kind is EventKind.ENABLED


# --- compile and TorchScript ------------------------------------------------------------------


def test_a_compiled_model_is_untouched_with_a_warning() -> None:
    model = make_two_towers()
    compiled = torch.compile(model, backend="eager")
    inner_hooks = hook_snapshot(model)
    compiled_cls = type(compiled)
    with pytest.warns(UserWarning, match="compile"):
        assert OOOModule(compiled, backend=SimulatedBackend(), planner="static") is compiled
    assert type(compiled) is compiled_cls
    assert type(model) is TwoTowers
    assert hook_snapshot(model) == inner_hooks
    event = only_event(compiled)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "compiled")


def test_a_wrapped_model_under_torch_compile_runs_stages_inline() -> None:
    torch._dynamo.reset()
    model = make_two_towers()
    plain = copy.deepcopy(model)
    backend = SimulatedBackend(keep_all=True)
    OOOModule(model, backend=backend, planner="static")
    backend.clear_log()
    compiled = torch.compile(model, backend="aot_eager")
    x = two_tower_input()
    steps = 3

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            model.zero_grad()
            plain.zero_grad()
            assert_trains_like(compiled, plain, x)
            events = model.events  # read every step: still one event
            assert [e.kind for e in events] == [EventKind.ENABLED, EventKind.BYPASSED]
    assert [str(w.message) for w in caught] == []

    assert backend.log == ()  # inline: no stream calls at all
    bypassed = model.events[-1]
    assert bypassed.reason == "compiling"
    assert bypassed.count == 1  # compiled calls are not counted one by one
    assert model.stats == ooo_wrap.OOOStats()

    # Eager again afterwards: side streams as before.
    model(x)
    assert model.stats.stage_calls == 2
    assert any(call.op == "set_stream" for call in backend.log)


def test_a_torchscript_module_is_untouched() -> None:
    scripted = torch.jit.script(Scriptable())
    cls = type(scripted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert OOOModule(scripted, backend=SimulatedBackend(), planner="static") is scripted
    assert type(scripted) is cls
    event = only_event(scripted)
    assert (event.kind, event.reason) == (EventKind.DISABLED, "unsupported_module")
    x = torch.randn(2, 4)
    assert scripted(x).shape == (2, 4)


def test_warnings_point_at_the_callers_line() -> None:
    with pytest.warns(UserWarning) as record:
        OOOModule(torch.compile(make_two_towers()), backend=SimulatedBackend(), planner="static")
        OOOModule(make_two_towers(), backend=NoStreamsBackend(), planner="static")
    ours = [w.filename for w in record if str(w.message).startswith("ooo_wrap")]
    assert ours == [__file__, __file__]


# --- a model returned untouched has no model.events: its events say where they are --------


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "case", ["cpu", "too_few_stages", "multi_device", "compiled", "script", "setup_failed"]
)
def test_every_untouched_model_says_to_read_its_events_with_events_for(case: str) -> None:
    model: nn.Module = make_two_towers()
    options: dict[str, Any] = {"backend": SimulatedBackend(), "planner": "static"}
    if case == "cpu":
        options = {"planner": "static"}
    elif case == "too_few_stages":
        options["stages"] = ["towers.0"]
    elif case == "multi_device":
        model.towers[1].to("meta")
    elif case == "compiled":
        model = torch.compile(model)  # type: ignore[assignment]
    elif case == "script":
        model = torch.jit.script(Scriptable())
    else:
        options["backend"] = NoStreamsBackend()
    assert OOOModule(model, **options) is model
    with pytest.raises(AttributeError):
        model.events  # noqa: B018  # untouched: nothing of the wrapper on it
    event = ooo_wrap.events_for(model)[-1]
    assert "returned untouched" in event.message
    assert "read its events with ooo_wrap.events_for(model)" in event.message
