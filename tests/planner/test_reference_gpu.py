"""The calibration seam: a ``ReferenceGPU`` saved as JSON and passed as ``gpu=`` to
``plan``, ``check`` and ``OOOModule`` (or ``--gpu PATH`` on the command line), so that a
measured reference replaces the datasheet one in the planner's learning and in the
checker's estimate."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

import ooo_wrap
from ooo_wrap import H200, ReferenceGPU
from ooo_wrap._wrapper.options import WrapOptions
from ooo_wrap.testing import SimulatedBackend, check
from tests.support.cli_helpers import run_cli

# What a small CPU model needs for a fork to pay: a near-free fork/join and launch.
MEASURED = dataclasses.replace(
    H200, name="measured stand-in", fork_join_us=1e-6, launch_us=0.1, kernel_floor_us=1.0
)


class Towers(nn.Module):
    """Two independent towers, far too small for a fork to pay on the datasheet H200."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.right = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.left(x) + self.right(x)


def test_json_round_trip(tmp_path: Path) -> None:
    assert ReferenceGPU.from_json(H200.to_json()) == H200
    assert ReferenceGPU.from_json(MEASURED.to_json()) == MEASURED
    data = json.loads(H200.to_json())
    assert data["peak_flops"]["bfloat16"] == 989e12 and data["launch_us"] == 5.0
    path = tmp_path / "gpu.json"
    MEASURED.save(path)
    assert ReferenceGPU.load(path) == MEASURED
    assert pickle.loads(pickle.dumps(MEASURED)) == MEASURED


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.pop("launch_us"), "needs exactly"),
        (lambda d: d.update(extra=1), "needs exactly"),
        (lambda d: d["peak_flops"].update(float33=1.0), "not a torch dtype"),
        (lambda d: d.update(sm_count=1.5), "sm_count"),
        (lambda d: d.update(launch_us=-1.0), ">= 0"),
        (lambda d: d.update(memory_bandwidth="fast"), "memory_bandwidth"),
        (lambda d: d.update(memory_bandwidth=0.0), "positive"),
    ],
)
def test_bad_json_is_refused(edit: object, match: str) -> None:
    data = json.loads(H200.to_json())
    edit(data)  # type: ignore[operator]
    with pytest.raises(ValueError, match=match):
        ReferenceGPU.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="must be JSON"):
        ReferenceGPU.from_json("{not json")


def test_gpu_flips_the_planners_decision_in_plan(tmp_path: Path) -> None:
    model, x = Towers(), torch.randn(8, 16)
    datasheet = ooo_wrap.plan(model, example_inputs=(x,))
    assert datasheet.learned is not None and datasheet.learned.outcome == "no_parallelism"
    path = tmp_path / "measured.json"
    MEASURED.save(path)
    for gpu in (MEASURED, path, str(path)):
        measured = ooo_wrap.plan(model, example_inputs=(x,), gpu=gpu)
        assert measured.learned is not None and measured.learned.gpu == "measured stand-in"
        assert measured.learned.outcome != "no_parallelism"
        assert {stage.name for stage in measured.stages} <= {"left", "right"}
        assert measured.stages  # one tower leaves the caller's stream
    with pytest.raises(ooo_wrap.OOOConfigError, match="cannot load a ReferenceGPU"):
        ooo_wrap.plan(model, example_inputs=(x,), gpu=tmp_path / "missing.json")
    with pytest.raises(ooo_wrap.OOOConfigError, match="gpu must be a ReferenceGPU"):
        ooo_wrap.plan(model, example_inputs=(x,), gpu=3)  # type: ignore[arg-type]


def test_gpu_flips_the_wrappers_decision_and_survives_copies() -> None:
    x = torch.randn(8, 16)
    datasheet = ooo_wrap.OOOModule(Towers(), 2, backend=SimulatedBackend())
    datasheet(x).sum().backward()
    assert not datasheet.plan.stages  # no_parallelism: the hooks are gone
    wrapped = ooo_wrap.OOOModule(Towers(), 2, backend=SimulatedBackend(), gpu=MEASURED)
    wrapped(x).sum().backward()
    stages = {stage.name for stage in wrapped.plan.stages}
    assert stages and stages <= {"left", "right"}
    assert wrapped.plan.learned is not None and wrapped.plan.learned.gpu == MEASURED.name
    for twin in (copy.deepcopy(wrapped), pickle.loads(pickle.dumps(wrapped))):
        twin(x).sum().backward()
        assert {stage.name for stage in twin.plan.stages} == stages
    with pytest.raises(ooo_wrap.OOOConfigError, match="gpu"):
        WrapOptions(gpu="/nowhere/gpu.json")  # type: ignore[arg-type]


def test_gpu_replaces_the_reference_in_checks_estimate() -> None:
    x = torch.randn(8, 16)
    datasheet = check(Towers(), x, planner="static", tune_arm="static")
    measured = check(Towers(), x, planner="static", gpu=MEASURED, tune_arm="static")
    assert datasheet.gpu == H200 and measured.gpu == MEASURED
    assert measured.estimate.gpu == "measured stand-in" and H200.name in str(datasheet)
    # A cheaper launch and floor: a shorter estimated step on the same ops.
    assert measured.estimate.wrapped_us < datasheet.estimate.wrapped_us
    # With the dataflow planner, the measured reference is what the wrapper learns on too.
    learned = check(Towers(), x, gpu=MEASURED, tune_arm="static")
    assert learned.ok and learned.learning_step == 1 and learned.gpu == MEASURED, str(learned)


def test_cli_passes_gpu(tmp_path: Path) -> None:
    path = tmp_path / "measured.json"
    MEASURED.save(path)
    argv = ["tests.planner.test_reference_gpu:Towers", "--input", "8x16", "--streams", "2"]
    plain = run_cli("plan", *argv)
    assert plain.status == 0 and "nothing to overlap" in plain.out
    measured = run_cli("plan", *argv, "--gpu", str(path))
    assert measured.status == 0 and "measured stand-in" in measured.out
    assert "nothing to overlap" not in measured.out
    checked = run_cli("check", *argv, "--gpu", str(path))
    assert checked.status == 0, checked.out + checked.err
    assert "measured stand-in" in checked.out
    broken = run_cli("check", *argv, "--gpu", str(tmp_path / "missing.json"))
    assert broken.status == 2 and "cannot load a ReferenceGPU" in broken.err


def test_calibration_keeps_the_datasheet_peaks_and_names_the_device() -> None:
    from benchmarks import calibrate

    measured = {"device": "Some GPU", "sm_count": 100, "launch_us": 3.0}
    measured |= {"kernel_floor_us": 1.25, "fork_join_us": 7.5}
    gpu = calibrate.reference_gpu(measured)
    assert (gpu.sm_count, gpu.launch_us, gpu.kernel_floor_us, gpu.fork_join_us) == (
        100,
        3.0,
        1.25,
        7.5,
    )
    assert gpu.peak_flops == H200.peak_flops and gpu.memory_bandwidth == H200.memory_bandwidth
    assert gpu.name.startswith("Some GPU (measured") and "H200 SXM datasheet" in gpu.name
    assert ReferenceGPU.from_json(gpu.to_json()) == gpu


def test_the_gemm_overlap_estimate_follows_occupancy() -> None:
    # The two-tower model's float32 GEMMs fill the GPU: side by side they gain only the
    # kernel floors; the same GEMMs in bfloat16 are short enough that the floors matter.
    import torch

    from benchmarks import calibrate

    for shape in calibrate.GEMM_SHAPES:
        occupancy, fp32 = calibrate._overlap_estimate(shape, torch.float32, 20)
        assert occupancy == 1.0 and 1.0 < fp32 < 1.1, fp32
        _, bf16 = calibrate._overlap_estimate(shape, torch.bfloat16, 20)
        assert bf16 > fp32
    one_block = calibrate._overlap_estimate((64, 64, 64), torch.float32, 20)
    assert one_block[0] < 0.1 and one_block[1] == pytest.approx(2.0)  # tiny: full overlap


def test_the_report_shows_measured_against_estimated_gemm_overlap() -> None:
    from benchmarks.report import gemm_overlap_lines

    assert gemm_overlap_lines(None) == []
    pair = {"shape": "1024x512 @ 512x2048", "dtype": "float32", "calls_per_stream": 20}
    pair |= {"serial_ms": 1.5, "concurrent_ms": 1.25, "measured_overlap": 1.2}
    pair |= {"estimated_overlap": 1.03, "estimated_occupancy": 1.0}
    lines = gemm_overlap_lines([pair])
    assert "| 1024x512 @ 512x2048 | float32 | 20 | 1.500 | 1.250 | 1.20x | 1.03x | 1.00 |" in lines
    assert any("estimate on the H200 datasheet" in line for line in lines)
