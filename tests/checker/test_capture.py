"""Simulated CUDA graph capture: its rules on hand-written code, and the scheduler under it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy
import pytest
import torch
from torch.nn import functional as F

from ooo_wrap.testing import (
    CaptureError,
    DetectingBackend,
    Detection,
    VirtualStream,
    detect,
    host_read,
)

CPU = torch.device("cpu")


@pytest.fixture
def found() -> Iterator[Detection]:
    with detect() as detection:
        yield detection


def _streams(found: Detection) -> tuple[DetectingBackend, VirtualStream, VirtualStream]:
    backend = found.backend
    return backend, backend.current_stream(CPU), backend.new_stream(CPU)


def _fork(b: DetectingBackend, main: VirtualStream, side: VirtualStream, x: torch.Tensor) -> None:
    b.record_stream(x, side)
    b.wait_event(side, b.record_event(main))
    b.set_stream(side)


def _join(b: DetectingBackend, main: VirtualStream, side: VirtualStream, y: torch.Tensor) -> None:
    b.record_stream(y, main)
    event = b.record_event(side)
    b.set_stream(main)
    b.wait_event(main, event)


def test_a_fork_and_join_inside_a_capture_is_clean(found: Detection) -> None:
    b, main, side = _streams(found)
    x = torch.ones(4)
    with b.capturing():
        assert b.is_capturing(main) and not b.is_capturing(side)
        _fork(b, main, side, x)
        assert b.is_capturing(side)  # as CUDA answers for a stream that joined
        y = x * 2
        _join(b, main, side, y)
        z = y + 1
    assert found.ok and found.captures == 1
    assert not b.is_capturing(main)
    assert host_read(z) is z  # after the capture, reading is fine


def test_an_op_on_a_stream_that_never_joined_fails(found: Detection) -> None:
    b, _, side = _streams(found)
    x = torch.ones(4)
    b.record_stream(x, side)
    with pytest.raises(CaptureError, match="side1 never joined"), b.capturing():
        b.set_stream(side)  # no fork: side would run now, outside the graph
        x.mul(2)


def test_an_event_recorded_on_a_stream_outside_the_capture_fails(found: Detection) -> None:
    b, _, side = _streams(found)
    with pytest.raises(CaptureError, match="event record on side1"), b.capturing():
        b.record_event(side)


def test_a_wait_on_an_event_from_before_the_capture_fails(found: Detection) -> None:
    b, main, side = _streams(found)
    before = b.record_event(main)
    with pytest.raises(CaptureError, match="a wait on"), b.capturing():
        b.wait_event(side, before)  # side would not join: the event is not the capture's
    with pytest.raises(CaptureError, match="across the capture's boundary"), b.capturing():
        b.wait_event(main, before)


def test_a_side_stream_not_rejoined_fails_at_the_end(found: Detection) -> None:
    b, main, side = _streams(found)
    x = torch.ones(4)
    with pytest.raises(CaptureError, match="side1 not rejoined"), b.capturing():
        _fork(b, main, side, x)
        x.mul(2)
        b.set_stream(main)  # no wait on side
    assert found.capture is None  # the failed capture is over


def test_a_stream_that_joined_and_ran_nothing_needs_no_rejoin(found: Detection) -> None:
    b, main, side = _streams(found)
    with b.capturing():
        b.wait_event(side, b.record_event(main))
    assert found.captures == 1


def test_a_stream_rejoined_through_another_stream_counts(found: Detection) -> None:
    b, main, side = _streams(found)
    other = b.new_stream(CPU)
    x = torch.ones(4)
    with b.capturing():
        _fork(b, main, side, x)
        y = x * 2
        b.record_stream(y, other)
        b.wait_event(other, b.record_event(side))
        b.set_stream(other)
        z = y + 1
        _join(b, main, other, z)
    assert found.ok


@pytest.mark.parametrize("read", ["host_read", "item"])
def test_a_host_read_inside_a_capture_fails(found: Detection, read: str) -> None:
    b = found.backend
    x = torch.ones(4)
    with pytest.raises(CaptureError, match="host read"), b.capturing():
        if read == "item":
            x.sum().item()
        else:
            host_read(x)


DATA_DEPENDENT = {
    "nonzero": lambda x: torch.nonzero(x),
    "where one arg": lambda x: torch.where(x > 0),
    "boolean mask": lambda x: x[x > 0],
    "boolean mask write": lambda x: x.clone().index_put_((x > 0,), torch.tensor(0.0)),
    "masked_select": lambda x: torch.masked_select(x, x > 0),
    "unique": lambda x: torch.unique(x),
    "repeat_interleave": lambda x: torch.repeat_interleave(torch.tensor([1, 2])),
    "equal": lambda x: torch.equal(x, x),
}


@pytest.mark.parametrize("name", sorted(DATA_DEPENDENT))
def test_an_op_whose_output_size_depends_on_the_data_fails(found: Detection, name: str) -> None:
    # On a GPU each waits for the device to learn its result: a host sync, which a
    # capture refuses; on the CPU nothing waits, so the simulation knows them by name.
    b = found.backend
    x = torch.tensor([1.0, -1.0, 2.0, 0.0])
    with pytest.raises(CaptureError, match="depends on the data"), b.capturing():
        DATA_DEPENDENT[name](x)


_SPD = torch.tensor([[2.0, 1.0], [1.0, 2.0]])

# On a GPU the host waits for the device at each: a copy to the host, a value read by
# Python, or a kernel that reads a result on the host. On the CPU none waits, and most
# show no aten op at all (the values are already there; printing even runs with
# dispatch modes off).
HOST_SYNCS: dict[str, Callable[[torch.Tensor], object]] = {
    "tolist": lambda x: x.tolist(),
    "cpu": lambda x: x.cpu(),
    "to cpu": lambda x: x.to("cpu"),
    "to device=cpu": lambda x: x.to(device="cpu", dtype=torch.float64),
    "numpy": lambda x: x.numpy(),
    "numpy.asarray": numpy.asarray,
    "print": print,
    "f-string": lambda x: f"{x}",
    "allclose": lambda x: torch.allclose(x, x),
    "linalg.cholesky": lambda x: torch.linalg.cholesky(_SPD),
    "linalg.inv": lambda x: torch.linalg.inv(_SPD),
    "linalg.solve": lambda x: torch.linalg.solve(_SPD, x[:2]),
    "linalg.cholesky_ex checking errors": lambda x: torch.linalg.cholesky_ex(
        _SPD, check_errors=True
    ),
    "histc without a range": lambda x: torch.histc(x, bins=4),
    "one_hot without num_classes": lambda x: F.one_hot(x.long().abs()),
}


@pytest.mark.parametrize("name", sorted(HOST_SYNCS))
def test_a_host_sync_that_no_cpu_op_shows_fails(found: Detection, name: str) -> None:
    b = found.backend
    x = torch.tensor([1.0, -1.0, 2.0, 0.0])
    with pytest.raises(CaptureError, match="the host waits for the device"), b.capturing():
        HOST_SYNCS[name](x)


@pytest.mark.parametrize("num_classes", [{"num_classes": 4}, {}], ids=["keyword", "positional"])
def test_one_hot_with_a_class_count_is_captured(
    found: Detection, num_classes: dict[str, int]
) -> None:
    # The MoE router's line. The CPU kernel checks the range on the host (an .item()
    # here), the CUDA kernel with a device assert: no host sync.
    b = found.backend
    chosen = torch.tensor([[0, 3], [2, 1]])
    with b.capturing():
        hot = F.one_hot(chosen, **num_classes) if num_classes else F.one_hot(chosen, 4)
    assert hot.shape == (2, 2, 4)
    assert found.ok and found.captures == 1


def test_fixed_size_forms_of_those_ops_are_captured(found: Detection) -> None:
    b = found.backend
    x = torch.tensor([1.0, -1.0, 2.0, 0.0])
    with b.capturing():
        x[torch.tensor([0, 2])]  # integer indices: the output size is the index's
        torch.where(x > 0, x, torch.zeros(()))  # three arguments: elementwise
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
        torch.nonzero_static(x, size=4)
        torch.histc(x, bins=4, min=-1, max=2)  # a range given: no min and max to read
        torch.linalg.cholesky_ex(_SPD)  # errors left in ``info``, on the device
        x.to(x.device), x.to(torch.float64)  # no copy to the host
    assert found.ok and found.captures == 1


def test_captures_do_not_nest(found: Detection) -> None:
    b = found.backend
    with pytest.raises(CaptureError, match="already underway"), b.capturing(), b.capturing():
        pass


def test_a_use_without_record_stream_inside_a_capture_is_an_allocator_hazard(
    found: Detection,
) -> None:
    """record_stream stays required under capture: without it the block would be reused
    inside the graph while the side stream reads it, in every replay."""
    b, main, side = _streams(found)
    x = torch.ones(4)
    with b.capturing():
        b.wait_event(side, b.record_event(main))  # a fork without record_stream(x, side)
        b.set_stream(side)
        y = x * 2
        _join(b, main, side, y)
    assert found.races == ()
    (hazard,) = found.allocator_hazards
    assert (hazard.allocated_on, hazard.access.stream) == ("default", "side1")


def test_outside_detect_capturing_only_sets_the_flag() -> None:
    b = DetectingBackend()
    main, side = b.current_stream(CPU), b.new_stream(CPU)
    with b.capturing():
        assert b.is_capturing(main) and not b.is_capturing(side)
        b.record_event(side)  # nothing is checked outside detect()
    assert not b.is_capturing(main)
