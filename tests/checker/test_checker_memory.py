"""Where the checker sees memory come and go: allocations the dispatcher shows only as a
view (``lift_fresh``), by ``out=`` and ``resize_``, and storages freed mid-block."""

from __future__ import annotations

import gc
import types
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from ooo_wrap.testing import Detection, VirtualStream, check, detect, host_read

CPU = torch.device("cpu")
MAIN = VirtualStream(0)


def _to_side(found: Detection, *inputs: torch.Tensor) -> VirtualStream:
    b = found.backend
    side = b.new_stream(CPU)
    b.wait_event(side, b.record_event(b.current_stream(CPU)))
    for tensor in inputs:
        b.record_stream(tensor, side)
    b.set_stream(side)
    return side


def _join(found: Detection, side: VirtualStream) -> None:
    b = found.backend
    b.set_stream(MAIN)
    b.wait_event(MAIN, b.record_event(side))


def _hazards(found: Detection) -> list[tuple[str, str, str]]:
    return [(h.access.op, h.access.stream, h.allocated_on) for h in found.allocator_hazards]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor([1.0, 2.0]),
        lambda: torch.as_tensor(np.ones(2, dtype=np.float32)),
        lambda: torch.from_numpy(np.ones(2, dtype=np.float32)),
    ],
    ids=["tensor", "as_tensor", "from_numpy"],
)
def test_a_tensor_made_from_host_data_is_allocated_on_the_current_stream(
    make: Callable[[], torch.Tensor],
) -> None:
    with detect() as found:
        side = _to_side(found)
        made = make()
        _join(found, side)
        host_read(made)  # no record_stream(default): its block goes back to side1's pool
    assert _hazards(found) == [("host_read", "default", "side1")]
    assert found.races == ()


class SideChannel(nn.Module):
    """A stage whose forward hook leaves a tensor behind, in the stage's own attribute or
    in an object it holds, which the parent reads."""

    def __init__(self, on: str) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.a.box = types.SimpleNamespace(stat=None)
        self.a.register_forward_hook(_remember_scale if on == "stage" else _box_scale)
        self.on = on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        stat = self.a.stat if self.on == "stage" else self.a.box.stat
        assert isinstance(stat, torch.Tensor)
        return self.b(h) * stat


def _remember_scale(module: nn.Module, args: object, output: torch.Tensor) -> None:
    module.stat = torch.tensor(2.0)


def _box_scale(module: nn.Module, args: object, output: torch.Tensor) -> None:
    module.box.stat = torch.tensor(2.0)


@pytest.mark.parametrize("on", ["stage", "box"])
def test_a_side_channel_tensor_made_in_a_stage(on: str) -> None:
    # Made on the stage's stream by its forward hook. In the stage's own attribute the
    # post-hook finds it and record_streams it for the caller's stream; in another
    # object's nothing does, and the parent's read is an allocator hazard.
    report = check(SideChannel(on), torch.randn(3, 4), streams=2, steps=1, planner="static")
    hazards = [(h.access.op, h.access.stream, h.allocated_on) for h in report.allocator_hazards]
    if on == "stage":
        assert report.ok, str(report)
        note = "untracked/attribute [a]: this stage holds a tensor in self.stat"
        assert any(note in line for line in report.notes), report.notes
    else:
        assert ("aten.mul.Tensor", "default", "side1") in hazards, str(report)
        assert "return it from the stage's forward()" in str(report)


def test_a_scalar_assigned_into_a_slice_is_a_fresh_tensor() -> None:
    with detect() as found:
        t = torch.zeros(2, 3)
        side = _to_side(found, t)
        t[..., 0] = 3  # lifts the scalar to a tensor on side1, then fills from it
        _join(found, side)
        host_read(t)
    assert found.ok, (found.races, found.allocator_hazards)
    assert "aten.lift_fresh.default" in [op.op for op in found.ops if op.stream == "side1"]


@pytest.mark.parametrize("how", ["out", "resize_"])
def test_memory_allocated_by_an_op_on_a_side_stream_belongs_to_that_stream(how: str) -> None:
    with detect() as found:
        a = torch.ones(16)
        result = torch.empty(0)
        side = _to_side(found, a, result)
        if how == "out":
            torch.add(a, 1, out=result)  # resizes the empty result: a new block on side1
        else:
            result.resize_(16).copy_(a)
        _join(found, side)
        host_read(result)
    assert _hazards(found) == [("host_read", "default", "side1")]


def test_a_freed_storage_forgets_its_history() -> None:
    with detect() as found:
        side = _to_side(found)
        old = torch.ones(1024) * 2  # written on side1
        key = old.untyped_storage().data_ptr()
        del old
        torch.zeros(1)  # the checker holds an op's results until the next op (autograd tags)
        gc.collect()
        _join(found, side)
        assert key not in found.tracker.storages
        fresh = torch.ones(1024)  # may reuse the address: its history starts here
        host_read(fresh)
    assert found.ok, (found.races, found.allocator_hazards)


def _two_sides(found: Detection, x: torch.Tensor) -> tuple[VirtualStream, VirtualStream]:
    b = found.backend
    sides = b.new_stream(CPU), b.new_stream(CPU)
    for side in sides:
        b.wait_event(side, b.record_event(MAIN))
        b.record_stream(x, side)
    return sides


@pytest.mark.parametrize(
    ("first", "second", "races"),
    [
        ((slice(0, 4), slice(None)), (slice(4, 8), slice(None)), False),  # row halves
        ((slice(0, 5), slice(None)), (slice(3, 8), slice(None)), True),  # rows 3 and 4 overlap
        # Column halves interleave in memory: their byte ranges overlap, so the checker
        # (which keeps one range per access, not every element) reports them.
        ((slice(None), slice(0, 2)), (slice(None), slice(2, 4)), True),
    ],
    ids=["disjoint_rows", "overlapping_rows", "interleaved_columns"],
)
def test_writes_to_parts_of_one_storage_race_only_where_their_bytes_overlap(
    first: tuple[slice, slice], second: tuple[slice, slice], races: bool
) -> None:
    with detect() as found:
        x = torch.zeros(8, 4)
        b = found.backend
        sides = _two_sides(found, x)
        for side, part, value in zip(sides, (first, second), (1.0, 2.0), strict=True):
            b.set_stream(side)
            x[part].fill_(value)
        b.set_stream(MAIN)
        for side in sides:
            b.wait_event(MAIN, b.record_event(side))
        host_read(x)
    if races:
        assert [(str(r.kind), r.earlier.stream, r.later.stream) for r in found.races] == [
            ("write-after-write", "side1", "side2")
        ]
    else:
        assert found.ok, found.races


class Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        return dst.copy_(self.lin(x))


class Halves(nn.Module):
    """Two stages that each write their half of one buffer the parent made."""

    def __init__(self) -> None:
        super().__init__()
        self.top, self.bottom = Half(), Half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffer = x.new_zeros(2, x.shape[0], 4)
        self.top(x, buffer[0])
        self.bottom(x, buffer[1])
        return buffer


def test_a_model_writing_its_halves_on_two_streams_is_clean() -> None:
    report = check(Halves(), torch.randn(3, 4), streams=2, planner="static", tune_arm="static")
    assert report.ok, str(report)
    rows = {row.stream: row for row in report.ops}
    assert rows["side1"].forward > 0 and rows["side2"].forward > 0


def test_a_tensor_from_host_data_at_a_reused_address_starts_a_new_history() -> None:
    # Adam's step counters (torch.tensor(0.0)) and T5's _shift_right hit this: the
    # allocator hands a side stream's freed block to a tensor made from host data.
    for _ in range(50):
        with detect() as found:
            side = _to_side(found)
            old = torch.empty(1024).fill_(2)  # written on side1, then freed
            address = old.data_ptr()
            del old
            torch.zeros(1)  # any op: nothing holds old any longer
            found.backend.set_stream(MAIN)  # no join: side1 may still be busy with old
            step = torch.tensor([0.0] * 1024)
            reused = step.data_ptr() == address
            step.add_(1)
            _join(found, side)
        if reused:
            assert found.ok, (found.races, found.allocator_hazards)
            return
    pytest.skip("the CPU allocator never reused the freed address here")
