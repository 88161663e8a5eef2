"""The benchmark kit's cost-model estimate of each point (``benchmarks/estimate.py``).

Only the estimate's structure and the schedule it models are asserted: its numbers are a
cost model's, to be calibrated against a GPU measurement, never checked against one here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks import estimate, report
from benchmarks.estimate import TraceEstimator, estimate_times
from benchmarks.measure import Point
from benchmarks.models import ModelSpec
from ooo_wrap._planner.cost import H200
from tests.project.test_benchmarks import _run as run_suite

SMALL = {
    "towers": ModelSpec.towers(3, 16, 2),
    "branches": ModelSpec.branches(4, 4, 2, 8),
    "transformer": ModelSpec.transformer(2, 16, 2, 8),
}


class _Spy(TraceEstimator):
    """Records the device of every estimate it makes; fails on the devices named."""

    def __init__(self, fail_on: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.devices: list[str] = []

    def _estimate_on(self, point: Point, device: torch.device) -> tuple[float, float]:
        self.devices.append(device.type)
        if device.type in self.fail_on:
            raise NotImplementedError(f"no {device.type} kernel")
        return super()._estimate_on(point, device)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(SMALL))
def test_every_family_gets_a_labelled_estimate_from_the_meta_device(
    family: str, dtype: Any
) -> None:
    spy = _Spy()
    rng = torch.get_rng_state()
    record = estimate_times(Point(SMALL[family], 4, dtype), spy)
    assert spy.devices == ["meta"]  # no arithmetic, whatever the point's size
    assert torch.equal(torch.get_rng_state(), rng)  # building the model left the RNG alone
    assert record["plain_ms"] > 0 and record["wrapped_ms"] > 0
    source = record["source"]
    assert "estimate, not measured" in source and H200.name in source
    assert "4 side streams" in source


def test_the_wrapped_estimate_is_the_wrapped_schedule() -> None:
    # Eight independent device-bound towers overlap on four streams, but their kernels
    # fill the GPU and share it by occupancy: only their floors overlap...
    heavy = estimate_times(Point(ModelSpec.towers(8, 2048, 4), 256, "float32"), TraceEstimator())
    assert 0.8 * heavy["plain_ms"] < heavy["wrapped_ms"] < heavy["plain_ms"]
    # ...while tiny ones are bound by host launches, and forking them only adds host cost.
    tiny = estimate_times(Point(SMALL["towers"], 2, "float32"), TraceEstimator())
    assert tiny["wrapped_ms"] > tiny["plain_ms"]


def test_one_estimate_per_point_and_the_cpu_when_meta_cannot_run_it() -> None:
    spy = _Spy(fail_on=("meta",))
    point = Point(SMALL["branches"], 2, "float32")
    first, second = spy(point), spy(point)
    assert first is not None and first == second
    assert spy.devices == ["meta", "cpu"]  # cached: the repeat cost nothing


def test_a_point_no_device_can_estimate_keeps_the_json_shape() -> None:
    spy = _Spy(fail_on=("meta", "cpu"))
    point = Point(SMALL["towers"], 2, "float32")
    assert estimate_times(point, spy) == {"plain_ms": None, "wrapped_ms": None, "source": None}
    assert "meta: NotImplementedError" in spy.failures[point]
    assert "cpu: NotImplementedError" in spy.failures[point]


def test_the_suite_records_the_estimate_and_names_its_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert isinstance(estimate.ESTIMATOR, TraceEstimator)  # wired in: the kit records it
    data, _ = run_suite(monkeypatch, "16", estimator=estimate.ESTIMATOR)
    recorded = data["results"][0]["estimate"]
    assert recorded["source"] == estimate.ESTIMATOR.source
    assert recorded["plain_ms"] > 0 and recorded["wrapped_ms"] > 0
    assert "(cost model, not measured)" in report.markdown_table(data["results"])
    text = report.render_report(data)
    assert f"Estimated columns: {estimate.ESTIMATOR.source}." in text
