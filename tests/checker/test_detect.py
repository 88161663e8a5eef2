"""The detector on hand-written multi-stream code: each hazard once broken, once correct."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ooo_wrap.testing import DetectingBackend, Detection, RaceKind, VirtualStream, detect, host_read

CPU = torch.device("cpu")
RAW = RaceKind.READ_AFTER_WRITE
WAR = RaceKind.WRITE_AFTER_READ
WAW = RaceKind.WRITE_AFTER_WRITE


def _streams(found: Detection) -> tuple[DetectingBackend, VirtualStream, VirtualStream]:
    backend = found.backend
    return backend, backend.current_stream(CPU), backend.new_stream(CPU)


def _fork(b: DetectingBackend, main: VirtualStream, side: VirtualStream, *inputs: torch.Tensor):
    """What the scheduler's pre-hook does: side waits on main; inputs recorded to side."""
    b.wait_event(side, b.record_event(main))
    for tensor in inputs:
        b.record_stream(tensor, side)
    b.set_stream(side)


def _races(found: Detection) -> list[tuple[RaceKind, str, str, str, str]]:
    return [
        (r.kind, r.earlier.op, r.earlier.stream, r.later.op, r.later.stream) for r in found.races
    ]


@pytest.mark.parametrize("broken", [True, False])
def test_consumer_on_another_stream_needs_a_wait(broken: bool) -> None:
    with detect() as found:
        b, main, side1 = _streams(found)
        side2 = b.new_stream(CPU)
        x = torch.ones(8)
        _fork(b, main, side1, x)
        y = x * 2
        b.record_stream(y, side2)
        if not broken:
            b.wait_event(side2, b.record_event(side1))
        b.set_stream(side2)
        z = y + 1
        b.set_stream(main)
        b.record_stream(z, main)
        b.wait_event(main, b.record_event(side2))
        host_read(z)
    if broken:
        assert _races(found) == [(RAW, "aten.mul.Tensor", "side1", "aten.add.Tensor", "side2")]
    else:
        assert found.races == ()
    assert found.allocator_hazards == ()


@pytest.mark.parametrize("broken", [True, False])
def test_parent_op_on_the_callers_stream_needs_a_join(broken: bool) -> None:
    with detect() as found:
        b, main, side = _streams(found)
        x = torch.ones(8)
        _fork(b, main, side, x)
        y = x * 2
        b.set_stream(main)
        b.record_stream(y, main)
        if not broken:
            b.wait_event(main, b.record_event(side))
        total = y.sum()
        host_read(total)
    if broken:
        assert _races(found) == [(RAW, "aten.mul.Tensor", "side1", "aten.sum.default", "default")]
    else:
        assert found.ok


@pytest.mark.parametrize("broken", [True, False])
def test_in_place_write_on_the_callers_stream_waits_for_side_readers(broken: bool) -> None:
    with detect() as found:
        b, main, side = _streams(found)
        x = torch.ones(8)
        _fork(b, main, side, x)
        y = x * 2
        b.set_stream(main)
        b.record_stream(y, main)
        if broken:
            x.add_(1)  # side may still be reading x
        b.wait_event(main, b.record_event(side))
        if not broken:
            x.add_(1)
        host_read(y)
    if broken:
        assert _races(found) == [(WAR, "aten.mul.Tensor", "side1", "aten.add_.Tensor", "default")]
        assert found.races[0].later.is_write and not found.races[0].earlier.is_write
    else:
        assert found.ok


# Each way the host reads a tensor, and the op it is recorded as. Only .item() is an
# aten op on the CPU; the others read memory in place (printing with dispatch modes off).
HOST_READS: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "host_read": (host_read, "host_read"),
    "item": (lambda t: t.item(), "aten._local_scalar_dense.default"),
    "tolist": (lambda t: t.tolist(), "Tensor.tolist"),
    "cpu": (lambda t: t.cpu(), "Tensor.cpu"),
    "to cpu": (lambda t: t.to("cpu"), "Tensor.to"),
    "numpy": (lambda t: t.numpy(), "Tensor.numpy"),
    "print": (print, "Tensor.__repr__"),
}


@pytest.mark.parametrize("read", sorted(HOST_READS))
@pytest.mark.parametrize("broken", [True, False])
def test_host_read_needs_a_final_join(broken: bool, read: str) -> None:
    how, op = HOST_READS[read]
    with detect() as found:
        b, main, side = _streams(found)
        x = torch.ones(8)
        _fork(b, main, side, x)
        y = x.sum()
        b.set_stream(main)
        b.record_stream(y, main)
        if not broken:
            b.wait_event(main, b.record_event(side))
        how(y)
    assert y.item() == 8.0
    if broken:
        assert _races(found) == [(RAW, "aten.sum.default", "side1", op, "default")]
    else:
        assert found.ok


@pytest.mark.parametrize("broken", [True, False])
def test_a_callers_tensor_used_on_a_side_stream_needs_record_stream(broken: bool) -> None:
    with detect() as found:
        b, main, side = _streams(found)
        x = torch.ones(8)
        b.wait_event(side, b.record_event(main))
        if not broken:
            b.record_stream(x, side)
        b.set_stream(side)
        y = x * 2
        b.set_stream(main)
        b.record_stream(y, main)
        b.wait_event(main, b.record_event(side))
        host_read(y)
    assert found.races == ()
    if broken:
        (hazard,) = found.allocator_hazards
        assert (hazard.access.op, hazard.access.stream) == ("aten.mul.Tensor", "side1")
        assert hazard.allocated_on == "default"
        assert (hazard.access.shape, hazard.access.dtype) == ((8,), "float32")
    else:
        assert found.ok


def test_views_share_their_storage() -> None:
    with detect() as found:
        b, main, side = _streams(found)
        x = torch.ones(4, 4)
        _fork(b, main, side, x)
        x[1:].mul_(2)  # writes the base through a view
        b.set_stream(main)
        x.t().sum()  # reads the base through another view, with no join
    assert _races(found) == [(RAW, "aten.mul_.Tensor", "side1", "aten.sum.default", "default")]


def test_write_after_write_is_reported() -> None:
    with detect() as found:
        b, main, side = _streams(found)
        x = torch.zeros(4)
        _fork(b, main, side, x)
        x.fill_(1)
        b.set_stream(main)
        x.fill_(2)
    assert _races(found) == [(WAW, "aten.fill_.Scalar", "side1", "aten.fill_.Scalar", "default")]


def test_a_backward_on_a_side_stream_is_ordered_by_the_engine() -> None:
    """Autograd nodes run on their forward stream; the engine's waits and record_stream
    calls (modelled by the detector) order the gradients, so nothing is reported."""
    weight = torch.randn(4, 4, requires_grad=True)
    with detect(keep_alive=[weight]) as found:
        b, main, side = _streams(found)
        x = torch.randn(2, 4)
        _fork(b, main, side, x)
        with found.stage("tower"):
            y = (x @ weight).tanh()
        b.set_stream(main)
        b.record_stream(y, main)
        b.wait_event(main, b.record_event(side))
        y.sum().backward()
        assert weight.grad is not None
        found.keep_alive(weight.grad)
        host_read(weight.grad)
    assert found.ok, found.races
    backward = [op for op in found.ops if op.phase == "backward"]
    assert {op.stream for op in backward if op.op == "aten.mm.default"} == {"side1"}
    assert {op.stage for op in backward if op.stream == "side1"} == {"tower"}


def test_detect_leaves_the_backend_usable_and_rejects_nesting() -> None:
    backend = DetectingBackend()
    with detect(backend), pytest.raises(RuntimeError, match="already inside"), detect(backend):
        pass
    with detect(backend) as found:
        torch.ones(2).sum()
    assert [op.op for op in found.ops] == ["aten.ones.default", "aten.sum.default"]
    assert host_read(torch.ones(1)).item() == 1.0  # outside detect(): a no-op
