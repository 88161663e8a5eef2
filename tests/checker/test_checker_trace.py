"""The checker's trace: ops on an estimated time axis, waits as arrows, findings marked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ooo_wrap._planner.cost import H200
from ooo_wrap.testing import CheckReport, OpRecord, VirtualEvent, VirtualStream, check
from ooo_wrap.testing import _check as check_module
from ooo_wrap.testing._timeline import lay_out, split_steps

# Big enough that a matmul outlasts a kernel launch on the reference GPU (about 18 µs
# against 5 µs), so whether streams overlap shows in the estimate.
DIM, BATCH = 1024, 512
LAUNCH, FORK = H200.launch_us, H200.fork_join_us / 2


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.left(x) * self.right(x)).sum()


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).relu()).sum()


def _saved(report: CheckReport, tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "trace.json"
    report.save_trace(path)
    events: list[dict[str, Any]] = json.loads(path.read_text())["traceEvents"]
    return events


def _overlaps(events: list[dict[str, Any]], phase: str) -> list[tuple[str, str]]:
    """Pairs of kernels of ``phase`` on different tracks that run at the same time."""
    kernels = [e for e in events if e["ph"] == "X" and e["cat"] == phase and e["dur"] > 0]
    return [
        (a["name"], b["name"])
        for a in kernels
        for b in kernels
        if a["tid"] < b["tid"] and a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]
    ]


def test_independent_towers_run_their_backward_concurrently(tmp_path: Path) -> None:
    report = check(
        Towers(), torch.randn(BATCH, DIM), streams=2, steps=1, planner="static", tune_arm="static"
    )
    assert report.ok, report
    events = _saved(report, tmp_path)
    assert ("mm.default", "mm.default") in _overlaps(events, "backward")
    estimate = report.estimate
    assert estimate.wrapped_us < estimate.one_stream_us
    assert f"on {H200.name}, not a measurement" in str(report)


def test_a_chain_never_runs_two_streams_at_once(tmp_path: Path) -> None:
    report = check(
        Chain(), torch.randn(BATCH, DIM), streams=2, steps=1, planner="static", tune_arm="static"
    )
    assert report.ok, report
    events = _saved(report, tmp_path)
    tracks = {e["tid"] for e in events if e["ph"] == "X" and e["cat"] == "backward"}
    assert {1, 2} <= tracks  # the links do run on two side streams...
    assert _overlaps(events, "backward") == []  # ...one after the other
    assert _overlaps(events, "forward") == []
    assert report.estimate.wrapped_us >= report.estimate.one_stream_us


def test_waits_are_arrows_from_the_op_waited_for(tmp_path: Path) -> None:
    report = check(
        Towers(), torch.randn(BATCH, DIM), streams=2, steps=1, planner="static", tune_arm="static"
    )
    events = _saved(report, tmp_path)
    slices = {e["args"]["seq"]: e for e in events if e["ph"] == "X"}
    starts = {e["id"]: e for e in events if e["ph"] == "s" and e["cat"] == "wait"}
    ends = {e["id"]: e for e in events if e["ph"] == "f" and e["cat"] == "wait"}
    assert starts and starts.keys() == ends.keys()
    for flow_id, start in starts.items():
        end = ends[flow_id]
        assert start["tid"] != end["tid"]
        assert end["bp"] == "e"
        # Each end lies inside an op on its track; the consumer starts after the producer ends.
        source = next(s for s in slices.values() if s["tid"] == start["tid"] and _inside(start, s))
        target = next(s for s in slices.values() if s["tid"] == end["tid"] and _inside(end, s))
        assert target["ts"] >= source["ts"] + source["dur"]
    # The end of backward: the caller's stream waits on both towers' last ops.
    step = [e for e in slices.values() if e["cat"] == "step"]
    first_step = min(step, key=lambda e: e["ts"])
    into_step = [f for f in ends.values() if _inside(f, first_step)]
    assert {starts[f["id"]]["tid"] for f in into_step} == {1, 2}


def _inside(point: dict[str, Any], slice_: dict[str, Any]) -> bool:
    return bool(slice_["ts"] <= point["ts"] <= slice_["ts"] + slice_["dur"])


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def test_races_are_marked_and_joined_by_an_arrow(tmp_path: Path) -> None:
    class NoJoin(check_module.DetectingBackend):
        def wait_event(self, stream: VirtualStream, event: VirtualEvent) -> None:
            if stream.id != 0:
                super().wait_event(stream, event)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(check_module, "DetectingBackend", NoJoin)
        report = check(_Small(), torch.randn(2, 4), planner="static", tune_arm="static")
    assert report.races
    events = _saved(report, tmp_path)
    marks = [e for e in events if e["ph"] == "i" and e["name"].startswith("race: ")]
    assert len(marks) == len(report.races)
    assert {m["args"]["detail"] for m in marks} == {str(r) for r in report.races}
    slices = {e["args"]["seq"]: e for e in events if e["ph"] == "X"}
    for race, mark in zip(report.races, marks, strict=True):
        assert mark["tid"] == slices[race.later.seq]["tid"]
        assert mark["ts"] == slices[race.later.seq]["ts"]
    race_flows = [e for e in events if e.get("cat") == "race" and e["ph"] in "sf"]
    assert len(race_flows) == 2 * len(report.races)


def test_allocator_hazards_are_marked(tmp_path: Path) -> None:
    class NoRecord(check_module.DetectingBackend):
        def record_stream(self, tensor: torch.Tensor, stream: VirtualStream) -> None:
            pass

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(check_module, "DetectingBackend", NoRecord)
        report = check(_Small(), torch.randn(2, 4), planner="static", tune_arm="static")
    assert report.allocator_hazards
    marks = [e for e in _saved(report, tmp_path) if e["name"] == "allocator hazard"]
    assert len(marks) == len(report.allocator_hazards)
    assert marks[0]["args"]["detail"] == str(report.allocator_hazards[0])


def _op(
    seq: int,
    stream: int,
    cost: float,
    clock: dict[int, int],
    phase: str = "forward",
    occupancy: float = 0.25,
) -> OpRecord:
    """A small kernel (a quarter of the GPU): concurrent ones do not slow each other."""
    pairs = tuple(sorted(clock.items()))
    return OpRecord(
        seq,
        f"s{stream}",
        stream,
        "aten.mm.default",
        None,
        phase,
        cost,
        pairs,
        occupancy,  # type: ignore[arg-type]
    )


def test_layout_follows_host_order_stream_order_and_waits() -> None:
    records = [
        _op(0, 0, 50.0, {0: 1}),
        _op(1, 1, 10.0, {1: 1}),  # independent: starts once issued, under op 0
        _op(2, 1, 10.0, {1: 2}),  # after op 1 on its stream
        _op(3, 2, 10.0, {0: 1, 2: 1}),  # waits for op 0
    ]
    timeline = lay_out(records)
    spans = [(s.start, s.end) for s in timeline.slots]
    assert spans[0] == (LAUNCH, LAUNCH + 50)
    assert spans[1] == (2 * LAUNCH, 2 * LAUNCH + 10)
    assert spans[2] == (2 * LAUNCH + 10, 2 * LAUNCH + 20)
    assert spans[3] == (LAUNCH + 50, LAUNCH + 60)
    assert timeline.waits == ((0, 3),)
    assert timeline.length_us == LAUNCH + 60
    serial = lay_out(records, one_stream=True)
    assert serial.length_us == LAUNCH + 80
    assert serial.waits == ()


def test_a_wait_costs_the_host_and_implied_waits_draw_no_arrow() -> None:
    records = [
        _op(0, 0, 10.0, {0: 1}),
        _op(1, 1, 10.0, {0: 1, 1: 1}),  # waits for op 0
        _op(2, 2, 10.0, {0: 1, 1: 1, 2: 1}),  # waits for op 1, which covers op 0
    ]
    timeline = lay_out(records)
    assert timeline.waits == ((0, 1), (1, 2))
    assert timeline.slots[1].start == LAUNCH + 10  # the device, not the host, is later
    assert timeline.slots[2].start == LAUNCH + 20
    # The host issued op 2 at 3 launches plus 2 waits: before op 1 ended.
    assert 3 * LAUNCH + 2 * FORK <= LAUNCH + 20


@pytest.mark.parametrize("sync_op", ["aten._local_scalar_dense.default", "aten.nonzero.default"])
def test_a_host_sync_holds_the_host_and_views_take_no_time(sync_op: str) -> None:
    # nonzero: its output size is data, so on a GPU the host waits for it as for .item()
    sync = OpRecord(1, "s0", 0, sync_op, None, "step", 10.0, ((0, 2),))
    view = OpRecord(2, "s1", 1, "aten.empty.memory_format", None, "step", 0.0, ((1, 1),))
    records = [_op(0, 0, 100.0, {0: 1}), sync, view, _op(3, 1, 10.0, {1: 2})]
    slots = lay_out(records).slots
    assert slots[1].end == LAUNCH + 100 + 10
    assert slots[2].start == slots[2].end == slots[1].end  # no launch charged
    assert slots[3].start == slots[1].end + LAUNCH


def test_steps_are_split_where_forward_starts_again() -> None:
    phases = ["forward", "forward", "backward", "step", "forward", "backward", "step"]
    records = [_op(i, 0, 1.0, {0: i + 1}, phase) for i, phase in enumerate(phases)]
    assert [[r.seq for r in step] for step in split_steps(records)] == [[0, 1, 2, 3], [4, 5, 6]]
