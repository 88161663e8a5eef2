"""check() guards the real scheduler: remove one step of the per-stage-call protocol and it reports.

Each step is removed by monkeypatching one scheduler hook so that, while it runs, one
backend method does nothing; the library itself has no switch for this.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from ooo_wrap._runtime.scheduler import Scheduler
from ooo_wrap.testing import CheckReport, DetectingBackend, RaceKind, check
from ooo_wrap.testing import _check as check_module

RAW = RaceKind.READ_AFTER_WRITE


class _Without:
    """A backend that ignores one of its methods and delegates everything else."""

    def __init__(self, backend: Any, method: str) -> None:
        self._backend = backend
        self._method = method

    def __getattr__(self, name: str) -> Any:
        if name == self._method:
            return lambda *args, **kwargs: None
        return getattr(self._backend, name)


def _remove(monkeypatch: pytest.MonkeyPatch, hook: str, method: str) -> None:
    """Make ``backend.<method>`` a no-op while ``Scheduler.<hook>`` runs."""
    original = getattr(Scheduler, hook)

    @functools.wraps(original)
    def patched(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        backend = self._backend
        self._backend = _Without(backend, method)
        try:
            return original(self, *args, **kwargs)
        finally:
            self._backend = backend

    monkeypatch.setattr(Scheduler, hook, patched)


class Chain(nn.Module):
    """Stage ``a`` feeds a parent op, whose result feeds stage ``b``; a residual add."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h.relu()) + h


def _check_chain() -> CheckReport:
    return check(Chain(), torch.randn(4, 8), planner="static", tune_arm="static")


def test_the_intact_protocol_passes() -> None:
    report = _check_chain()
    assert report.ok, str(report)
    assert {row.stream for row in report.ops} == {"default", "side1", "side2"}


def test_without_the_producer_wait_a_stage_reads_unordered_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_stage_pre_hook", "wait_event")
    report = _check_chain()
    assert not report.ok
    # b reads relu's output (written on the caller's stream) before its stream waited.
    assert any(
        r.kind is RAW
        and r.earlier.stream == "default"
        and r.later.stream == "side2"
        and r.later.stage == "b"
        for r in report.races
    ), str(report)


def test_without_record_stream_on_inputs_the_allocator_may_reuse_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_stage_pre_hook", "record_stream")
    report = _check_chain()
    assert report.races == ()
    hazards = {(h.allocated_on, h.access.stream, h.access.stage) for h in report.allocator_hazards}
    assert ("default", "side1", "a") in hazards  # the model's input x
    assert ("default", "side2", "b") in hazards  # relu's output


def test_without_record_stream_on_outputs_the_allocator_may_reuse_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_stage_post_hook", "record_stream")
    report = _check_chain()
    assert report.races == ()
    assert any(
        h.allocated_on == "side1" and h.access.stream == "default" for h in report.allocator_hazards
    ), str(report)


def test_without_the_ambient_join_a_parent_op_reads_an_unfinished_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_stage_post_hook", "wait_event")
    report = _check_chain()
    assert any(
        r.kind is RAW
        and (r.earlier.stream, r.earlier.stage) == ("side1", "a")
        and (r.later.stream, r.later.op) == ("default", "aten.relu.default")
        for r in report.races
    ), str(report)


def test_without_the_root_join_alone_a_plain_model_still_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The root join is redundant for a model that never switches streams itself: each
    stage's post-hook already made the caller's stream wait on an event recorded after
    all of the stage's work, and nothing is queued on a stage stream between a stage's
    post-hook and the root's. The checker must not invent a finding here."""
    _remove(monkeypatch, "_root_post_hook", "wait_event")
    assert _check_chain().ok


def test_without_the_root_and_ambient_joins_the_loss_reads_unfinished_stages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_root_post_hook", "wait_event")
    _remove(monkeypatch, "_stage_post_hook", "wait_event")
    report = check(Towers(), torch.randn(4, 8), planner="static", tune_arm="static")
    later = {(r.later.stream, r.later.phase) for r in report.races if r.kind is RAW}
    assert ("default", "forward") in later, str(report)


class Towers(nn.Module):
    """Two stages whose outputs the model returns as they are (no parent op)."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.left(x), self.right(x)


class OwnStream(nn.Module):
    """Calls stage ``a`` under a stream of its own, hands the result back correctly
    (``record_stream`` to the caller's stream) but relies on the library's root join to
    order it before the caller reads the output."""

    backends: ClassVar[list[DetectingBackend]] = []

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        backend = self.backends[-1]
        caller = backend.current_stream(x.device)
        own = backend.new_stream(x.device)
        backend.wait_event(own, backend.record_event(caller))
        backend.record_stream(x, own)
        backend.set_stream(own)
        try:
            y = self.a(x)
        finally:
            backend.set_stream(caller)
        backend.record_stream(y, caller)
        return y, self.b(x)


@pytest.fixture
def own_stream_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let OwnStream reach the backend check() creates."""

    class Recorded(DetectingBackend):
        def __init__(self) -> None:
            super().__init__()
            OwnStream.backends.append(self)

    monkeypatch.setattr(check_module, "DetectingBackend", Recorded)
    monkeypatch.setattr(OwnStream, "backends", [])


@pytest.mark.usefixtures("own_stream_backends")
def test_the_root_join_orders_stages_run_under_a_models_own_stream() -> None:
    assert check(OwnStream(), torch.randn(4, 8), planner="static", tune_arm="static").ok


@pytest.mark.usefixtures("own_stream_backends")
def test_without_the_root_join_a_models_own_stream_leaves_a_stage_unordered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_root_post_hook", "wait_event")
    report = check(OwnStream(), torch.randn(4, 8), planner="static", tune_arm="static")
    assert any(
        r.kind is RAW
        and (r.earlier.stream, r.earlier.stage) == ("side1", "a")
        and r.later.stream == "default"
        for r in report.races
    ), str(report)
