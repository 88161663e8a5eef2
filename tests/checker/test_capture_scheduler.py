"""The scheduler under simulated CUDA graph capture: both graph recipes, check(capture=True),
and each synchronization point removed (the simulation or the checker must fail).

Points are removed by monkeypatching one scheduler hook, as in ``test_checker_guards.py``.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from ooo_wrap import EventKind, OOOModule
from ooo_wrap.testing import (
    CaptureError,
    CheckReport,
    DetectingBackend,
    Detection,
    OpRecord,
    VirtualStream,
    check,
    detect,
)
from ooo_wrap.testing._timeline import split_steps
from tests.checker.test_checker_guards import OwnStream, Towers, _remove
from tests.support import overlap_models as om
from tests.support.reference import FREE_FORK


def _captured_step(report: CheckReport) -> list[OpRecord]:
    return split_steps(report.trace)[-1]


def _side_ops(records: list[OpRecord] | tuple[OpRecord, ...]) -> set[tuple[str, str]]:
    return {(r.stream, r.phase) for r in records if r.stream != "default"}


# --- check(capture=True) ---------------------------------------------------------------


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_a_captured_step_of_towers_runs_on_side_streams(overlap_forward: bool) -> None:
    # Regression: stages used to run inline under capture (BYPASSED/graph_capture), so the
    # captured step had no side-stream op at all.
    report = check(
        Towers(),
        torch.randn(4, 8),
        planner="static",
        tune_arm="static+overlap" if overlap_forward else "static",
        capture=True,
        overlap_forward=overlap_forward,
    )
    assert report.ok and report.captured, str(report)
    assert "the last one under simulated graph capture" in str(report)
    assert not any("bypassed" in note for note in report.notes)
    side = _side_ops(_captured_step(report))
    assert {("side1", "forward"), ("side2", "forward")} <= side
    assert {("side1", "backward"), ("side2", "backward")} <= side


def test_the_learned_plan_is_captured_after_an_eager_learning_step() -> None:
    report = check(om.TowersSum(), om.inputs(), capture=True, steps=3, gpu=FREE_FORK)
    assert report.ok and report.captured, str(report)
    assert ("side1", "backward") in _side_ops(_captured_step(report))


def test_capture_with_the_dataflow_planner_needs_a_learning_step() -> None:
    with pytest.raises(ValueError, match="steps >= 2"):
        check(Towers(), torch.randn(4, 8), capture=True, steps=1)
    report = check(Towers(), torch.randn(4, 8), planner="static", capture=True, steps=1)
    assert report.ok and report.captured, str(report)


# --- each synchronization point removed under capture ----------------------------------


def _check_towers(**options: bool) -> CheckReport:
    return check(Towers(), torch.randn(4, 8), planner="static", capture=True, **options)


@pytest.mark.filterwarnings("ignore:module forward hook")
def test_without_the_fork_wait_a_side_stream_never_joins(monkeypatch: pytest.MonkeyPatch) -> None:
    _remove(monkeypatch, "_stage_pre_hook", "wait_event")
    with pytest.raises(CaptureError, match="side1 never joined"):
        _check_towers()


def test_without_the_stage_joins_the_root_join_alone_rejoins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_stage_post_hook", "wait_event")
    assert _check_towers().ok


def _capture_forward(model: nn.Module, *, overlap_forward: bool = False) -> Detection:
    """Wrap ``model``, run one eager training step, then capture a forward alone (grad
    enabled, as ``make_graphed_callables`` does): only the forward's own joins can bring
    the side streams back before the capture ends."""
    backend = DetectingBackend()
    wrapped = OOOModule(
        model, 4, backend=backend, planner="static", overlap_forward=overlap_forward
    )
    x = om.inputs()
    with detect(backend, keep_alive=[wrapped]) as found:
        _loss_of(wrapped(x)).backward()
        with backend.capturing():
            wrapped(x)
    return found


def _loss_of(output: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    outputs = output if isinstance(output, tuple) else (output,)
    return torch.stack([t.sum() for t in outputs]).sum()


@pytest.mark.parametrize("overlap_forward", [False, True])
def test_a_forward_captured_alone_rejoins_every_stream(overlap_forward: bool) -> None:
    found = _capture_forward(om.TowersReturned(), overlap_forward=overlap_forward)
    assert found.ok and found.captures == 1
    origin = found.tracker.snapshot(VirtualStream(0))
    for side in (VirtualStream(1), VirtualStream(2)):
        last = found.tracker.snapshot(side)[side]
        assert last > 0 and origin[side] >= last  # its last op is covered: rejoined


def test_a_no_grad_forward_with_overlap_forward_is_captured_on_side_streams() -> None:
    # The shape of the cuda-marked capture test: inference keeps its side streams with
    # overlap_forward, and the root join finishes the pending joins inside the capture.
    torch.manual_seed(0)
    plain = om.TowersSum()
    backend = DetectingBackend()
    model = OOOModule(
        copy.deepcopy(plain), 4, backend=backend, planner="static", overlap_forward=True
    )
    x = om.inputs()
    with detect(backend, keep_alive=[model]) as found, torch.no_grad():
        model(x)  # warm-up
        start = len(found.ops)
        with backend.capturing():
            out = model(x)
    assert found.ok and found.captures == 1
    assert ("side1", "forward") in _side_ops(_captured(found, start))
    assert torch.equal(out, plain(x))


def test_without_the_joins_a_captured_forward_ends_unjoined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_stage_post_hook", "wait_event")
    _remove(monkeypatch, "_root_post_hook", "wait_event")
    with pytest.raises(CaptureError, match="side1, side2 not rejoined"):
        _capture_forward(om.TowersReturned())


def test_without_the_root_join_deferred_joins_leave_the_capture_unjoined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With overlap_forward the stage joins are left pending: the root join finishes them."""
    _remove(monkeypatch, "_root_post_hook", "wait_event")
    with pytest.raises(CaptureError, match="side1, side2 not rejoined"):
        _capture_forward(om.TowersReturned(), overlap_forward=True)


def test_without_the_root_join_a_models_own_stream_leaves_the_capture_unjoined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stage ``a`` forks from a stream the model set itself and joins back to it; only the
    root join brings ``a``'s stream back to the stream the capture began on."""

    class Recorded(DetectingBackend):
        def __init__(self) -> None:
            super().__init__()
            OwnStream.backends.append(self)

    monkeypatch.setattr(OwnStream, "backends", [])
    monkeypatch.setattr(__name__ + ".DetectingBackend", Recorded)
    assert _capture_forward(OwnStream()).ok
    _remove(monkeypatch, "_root_post_hook", "wait_event")
    with pytest.raises(CaptureError, match="side1 not rejoined"):
        _capture_forward(OwnStream())


def test_without_record_stream_under_capture_the_allocator_may_reuse_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _remove(monkeypatch, "_stage_pre_hook", "record_stream")
    report = _check_towers()
    assert report.races == ()
    assert ("default", "side1") in {
        (h.allocated_on, h.access.stream) for h in report.allocator_hazards
    }, str(report)


# --- the two graph recipes, simulated --------------------------------------------------


def _wrapped() -> tuple[nn.Module, OOOModule, DetectingBackend]:
    torch.manual_seed(0)
    plain = om.TowersReturned()
    backend = DetectingBackend()
    model = OOOModule(copy.deepcopy(plain), 4, backend=backend, planner="static")
    assert isinstance(model, OOOModule)
    return plain, model, backend


def _captured(found: Detection, start: int) -> tuple[OpRecord, ...]:
    return found.ops[start:]


def test_make_graphed_callables_shape_forward_and_backward_captured_apart() -> None:
    """A forward captured alone (grad enabled), then its backward captured alone with
    ``torch.autograd.grad(outputs, inputs + params, grad_outputs)``."""
    plain, model, backend = _wrapped()
    x = om.inputs().requires_grad_()
    plain_x = x.detach().clone().requires_grad_()
    inputs = (x, *model.parameters())
    with detect(backend, keep_alive=[model]) as found:
        warm = model(x)  # warm-up, eager
        torch.autograd.grad(warm, inputs, [torch.ones_like(t) for t in warm])
        del warm
        start = len(found.ops)
        with backend.capturing():
            static_out = model(x)
        forward_ops = _captured(found, start)
        static_grad_out = [torch.ones_like(t) for t in static_out]
        start = len(found.ops)
        with backend.capturing():
            grads = torch.autograd.grad(static_out, inputs, static_grad_out)
        backward_ops = _captured(found, start)
    assert found.ok and found.captures == 2, (found.races, found.allocator_hazards)
    assert {("side1", "forward"), ("side2", "forward")} <= _side_ops(forward_ops)
    assert {("side1", "backward"), ("side2", "backward")} <= _side_ops(backward_ops)
    assert not [e for e in model.events if e.kind is EventKind.BYPASSED]
    out = plain(plain_x)
    expected = torch.autograd.grad(
        out, (plain_x, *plain.parameters()), [torch.ones_like(t) for t in out]
    )
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)


def test_a_whole_training_step_captured_at_once() -> None:
    """Forward, loss, backward and the optimizer step in one capture, after warm-up."""
    plain, model, backend = _wrapped()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = torch.optim.SGD(plain.parameters(), lr=0.1)
    x = om.inputs()
    with detect(backend, keep_alive=[model]) as found:
        for step in range(2):
            optimizer.zero_grad(set_to_none=True)
            start = len(found.ops)
            with backend.capturing() if step == 1 else contextlib.nullcontext():
                left, right = model(x)
                (left.square().sum() + right.sum()).backward()
                found.keep_alive(*(p.grad for p in model.parameters() if p.grad is not None))
                with found.phase("step"):
                    optimizer.step()
    assert found.ok and found.captures == 1, (found.races, found.allocator_hazards)
    side = _side_ops(_captured(found, start))
    assert {("side1", "forward"), ("side1", "backward"), ("side2", "backward")} <= side
    assert not [e for e in model.events if e.kind is EventKind.BYPASSED]
    for _ in range(2):
        reference.zero_grad(set_to_none=True)
        left, right = plain(x)
        (left.square().sum() + right.sum()).backward()
        reference.step()
    for got, want in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(got, want)
