"""check() guards each join point of ``overlap_forward``: remove one and it reports a race.

Each join point is removed by monkeypatching the function or hook that queues it; the
library itself has no switch for this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap._runtime import deferred as _deferred
from ooo_wrap._runtime.scheduler import Scheduler
from ooo_wrap.testing import CaptureError, CheckReport, DetectingBackend, RaceKind, check, detect
from ooo_wrap.testing import _check as check_module
from tests.checker.test_checker_guards import _remove
from tests.support import overlap_models as om

RAW = RaceKind.READ_AFTER_WRITE
CPU = torch.device("cpu")


def _check(factory: Callable[[], nn.Module]) -> CheckReport:
    torch.manual_seed(0)
    return check(factory(), om.inputs(), overlap_forward=True, planner="static")


def _raw(report: CheckReport, earlier_stage: str, later_stream: str | None = None) -> bool:
    return any(
        r.kind is RAW
        and r.earlier.stage == earlier_stage
        and r.later.stream != r.earlier.stream
        and (later_stream is None or r.later.stream == later_stream)
        for r in report.races
    )


def test_without_the_wait_on_received_outputs_the_next_stage_reads_them_unordered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _check(om.DirectFeed).ok
    monkeypatch.setattr(_deferred, "wait_for_inputs", lambda *args: 0)
    report = _check(om.DirectFeed)
    assert _raw(report, "a") and _raw(report, "split"), str(report)


def test_an_input_written_in_place_is_tracked_by_storage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fill`` writes into a view of ``buf``; ``c`` receives ``buf`` itself."""
    assert _check(om.InPlaceFill).ok
    with monkeypatch.context() as patched:
        patched.setattr(_deferred, "_keys", lambda tensors: [id(t) for t in tensors])
        assert _raw(_check(om.InPlaceFill), "fill", "side2")
    monkeypatch.setattr(_deferred, "written", lambda inputs, before: [])
    assert _raw(_check(om.InPlaceFill), "fill", "side2")


@pytest.mark.parametrize(
    ("factory", "kind"),
    [
        (om.SharedNorm, RaceKind.WRITE_AFTER_WRITE),
        (functools.partial(om.SharedBuffer, (True, False)), RAW),
        (functools.partial(om.SharedBuffer, (False, True)), RaceKind.WRITE_AFTER_READ),
    ],
    ids=["batch_norm", "first_writes", "second_writes"],
)
def test_without_the_wait_on_sharing_stages_b_races_a_on_their_buffer(
    monkeypatch: pytest.MonkeyPatch, factory: Callable[[], nn.Module], kind: RaceKind
) -> None:
    assert _check(factory).ok
    monkeypatch.setattr(_deferred, "wait_for_sharing", lambda *args: 0)
    report = _check(factory)
    assert any(
        r.kind is kind
        and (r.earlier.stage, r.later.stage) == ("a", "b")
        and r.later.stream != r.earlier.stream
        for r in report.races
    ), str(report)


def _no_join(
    self: _deferred.JoinOnTouch,
    func: Callable[..., Any],
    types: Sequence[type],
    args: Sequence[Any] = (),
    kwargs: Any = None,
) -> Any:
    return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("name", "stage", "op"),
    [
        ("parent_op_between", "a", "aten.mul.Tensor"),
        ("host_read", "a", "aten._local_scalar_dense.default"),
        ("towers_sum", "towers.0", "aten.add.Tensor"),
        ("towers_cat", "towers.0", "aten.cat.default"),
        ("residual_chain", "blocks.0", "aten.add.Tensor"),
    ],
)
def test_without_the_join_on_touch_a_parent_op_reads_an_unfinished_stage(
    monkeypatch: pytest.MonkeyPatch, name: str, stage: str, op: str
) -> None:
    monkeypatch.setattr(_deferred.JoinOnTouch, "__torch_function__", _no_join)
    report = _check(om.ACCEPTANCE[name])
    assert any(
        r.kind is RAW
        and r.earlier.stage == stage
        and (r.later.stream, r.later.op) == ("default", op)
        for r in report.races
    ), str(report)


def test_without_the_root_join_the_loss_reads_unfinished_towers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _check(om.TowersReturned).ok
    _remove(monkeypatch, "_root_post_hook", "wait_event")
    report = _check(om.TowersReturned)
    assert _raw(report, "left", "default") and _raw(report, "right", "default"), str(report)


class CapturedSecond(nn.Module):
    """Begins a (simulated) graph capture between its stages, while stage ``a``'s join
    is pending: stage ``b`` receives ``a``'s output, so its stream must wait on that join,
    recorded before the capture began."""

    backends: ClassVar[list[DetectingBackend]] = []

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(om.DIM, om.DIM)
        self.b = nn.Linear(om.DIM, om.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with self.backends[-1].capturing():
            out: torch.Tensor = self.b(h)
        return out


@pytest.fixture
def captured_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let CapturedSecond reach the backend check() creates."""

    class Recorded(DetectingBackend):
        def __init__(self) -> None:
            super().__init__()
            CapturedSecond.backends.append(self)

    monkeypatch.setattr(check_module, "DetectingBackend", Recorded)
    monkeypatch.setattr(CapturedSecond, "backends", [])


@pytest.mark.usefixtures("captured_backends")
@pytest.mark.filterwarnings("ignore:module forward hook")
def test_a_capture_begun_while_a_join_is_pending_is_refused() -> None:
    """Stages fork under capture now (they ran inline there before), so ``b``'s wait on
    ``a``'s pending join would cross the capture's boundary, as on a GPU: begin captures
    outside a forward with ``overlap_forward``."""
    with pytest.raises(CaptureError, match="across the capture's boundary"):
        _check(CapturedSecond)


class SwitchAfter(nn.Module):
    """After stage ``a`` returns, the parent reads its output on a stream of its own,
    which it orders after its caller's stream the usual way (an event and a wait): that
    wait comes before the deferred join, so the join must reach that stream too."""

    backends: ClassVar[list[DetectingBackend]] = []

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(om.DIM, om.DIM)
        self.b = nn.Linear(om.DIM, om.DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        other = self.b(x)
        backend = self.backends[-1]
        caller = backend.current_stream(CPU)  # CPU made outside: torch.device() joins too
        own = backend.new_stream(CPU)
        backend.wait_event(own, backend.record_event(caller))
        backend.set_stream(own)
        try:
            backend.record_stream(h, own)  # the first touch of h, on the parent's stream
            y = h * 2
        finally:
            backend.set_stream(caller)
        backend.record_stream(y, caller)
        backend.wait_event(caller, backend.record_event(own))
        return y + other


@pytest.fixture
def switch_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    class Recorded(DetectingBackend):
        def __init__(self) -> None:
            super().__init__()
            SwitchAfter.backends.append(self)

    monkeypatch.setattr(check_module, "DetectingBackend", Recorded)
    monkeypatch.setattr(SwitchAfter, "backends", [])


@pytest.mark.usefixtures("switch_backends")
def test_a_touch_on_a_stream_the_parent_switched_to_waits_there_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _check(SwitchAfter).ok
    original = _deferred.join_from
    monkeypatch.setattr(_deferred, "join_from", lambda level, touched=False: original(level))
    report = _check(SwitchAfter)
    assert any(
        r.kind is RAW
        and r.earlier.stage == "a"
        and r.later.op == "aten.mul.Tensor"
        and r.later.stream == "side3"
        for r in report.races
    ), str(report)


class HandsToDisabledModel(nn.Module):
    """Hands stage ``a``'s pending output to another wrapped model called under
    ``ooo_wrap.disabled()``: that model's stage runs inline on the caller's stream, one
    level down, where the join-on-touch mode does not look. Its pre-hook must join first.
    The other model is held outside the module tree (a wrapped model cannot nest)."""

    def __init__(self, other: nn.Module) -> None:
        super().__init__()
        self.a = nn.Linear(om.DIM, om.DIM)
        self.b = nn.Linear(om.DIM, om.DIM)
        self.others = [other]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with ooo_wrap.disabled():
            return self.others[0](h) + self.b(x)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Linear(om.DIM, om.DIM)
        self.q = nn.Linear(om.DIM, om.DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.q(self.p(h))


def _disabled_handoff_races() -> list[str]:
    torch.manual_seed(0)
    backend = DetectingBackend()
    other = ooo_wrap.OOOModule(Head(), backend=backend, planner="static", stages=["p", "q"])
    model = HandsToDisabledModel(other)
    ooo_wrap.OOOModule(
        model, backend=backend, planner="static", stages=["a", "b"], overlap_forward=True
    )
    with detect(backend, keep_alive=[model, other]) as found:
        model(om.inputs()).sum().backward()
    # The model's streams come after the other's: ``a`` runs on side3.
    return [f"{r.kind} {r.earlier.stream} -> {r.later.stream} {r.later.op}" for r in found.races]


def test_a_stage_run_inline_by_another_model_joins_the_pending_stages_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _disabled_handoff_races() == []
    join_from = _deferred.join_from
    original = Scheduler._stage_pre_hook

    def pre_hook(self: Scheduler, *args: Any) -> None:
        _deferred.join_from = lambda level, **kwargs: None  # type: ignore[assignment]
        try:
            original(self, *args)
        finally:
            _deferred.join_from = join_from  # type: ignore[assignment]

    monkeypatch.setattr(Scheduler, "_stage_pre_hook", pre_hook)
    races = _disabled_handoff_races()
    assert "read-after-write side3 -> default aten.addmm.default" in races, races


def test_with_the_join_mode_pushed_on_top_a_user_mode_block_pops_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The join mode goes under the user's modes: pushed on top instead, leaving the
    user's ``with`` block pops it, and the parent reads stage ``a`` unjoined."""
    depth = torch._C._len_torch_function_stack()
    assert _check(om.UserModeAround).ok
    monkeypatch.setattr(
        _deferred, "put_function_mode_under", torch._C._push_on_torch_function_stack
    )
    try:
        report = _check(om.UserModeAround)
    finally:
        while torch._C._len_torch_function_stack() > depth:  # the user's mode, left on it
            torch._C._pop_torch_function_stack()
    assert _raw(report, "a", "default"), str(report)


def test_without_the_blind_search_rules_a_deeply_nested_pending_output_races(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage whose inputs the search could not all see waits on every pending join; a
    stage whose outputs it could not all see is joined at once."""
    wait_for_inputs, defer = _deferred.wait_for_inputs, _deferred.defer
    monkeypatch.setattr(
        _deferred, "wait_for_inputs", lambda *args: wait_for_inputs(*args[:3], False)
    )
    assert _raw(_check(om.DeepFeed), "a", "side2")
    assert _check(om.DeepReturn).races == ()
    monkeypatch.setattr(_deferred, "defer", lambda *args: defer(*args[:5], False))
    assert _raw(_check(om.DeepReturn), "a", "side2")
