"""A stand-in for ``python3`` on the GPU machine, so ``scripts/gpu_check.sh`` dry-runs on a CPU.

``tests/project/test_gpu_kit.py`` runs the kit with ``PYTHON`` pointing at a wrapper that calls
this file with the kit's arguments. It makes ``torch.cuda`` say a GPU is there, blocks
every network connection (the GPU machine has none), and stands in for each program the
kit runs, keeping the kit's own logic (time limits, verdicts, files, summary) real:

- ``-`` (the preflight) runs as it is, against the patched ``torch.cuda``;
- ``-m pytest``: ``tests/gpu/test_cuda.py`` becomes a generated file of passing ``cuda``
  tests (or failing ones, ``STANDIN_CUDA_TESTS=fail``); the optional step's ``tests``
  becomes one passing module and one that fails to import;
- ``scripts/sanitizer_check.py`` runs its real ``main`` with the GPU work replaced: clean
  runs succeed, the deliberate races raise an error named as the sanitizer's does;
- ``benchmarks/suite.py`` runs its real ``main`` with ``measure_point`` replaced by a
  record of fixed numbers for every mode asked for (and the calibration's measurements,
  ``benchmarks/calibrate.measure``, by fixed floors) (a graphed wrapped side reports the
  wrapper inline under capture, as today's wrapper runs it); the point at batch
  ``STANDIN_FAIL_BATCH`` raises, and the graphed modes of the family
  ``STANDIN_FAIL_CAPTURE`` fail to capture;
- anything else (``scripts/gpu_kit.py``) runs unchanged.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[2]
GPU_NAME = "Stand-in GPU (CPU dry run)"

CORE_CASES = """
import pytest

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("n", [1, 2])
def test_stand_in(n):
    assert {outcome}
"""
OPTIONAL_OK = """
import pytest


@pytest.mark.cuda
def test_optional_stand_in():
    assert True
"""
OPTIONAL_BROKEN = "import module_that_does_not_exist  # an import error in one module\n"


def _no_network(*args: Any, **kwargs: Any) -> NoReturn:
    raise OSError("stand-in: the GPU machine has no network; something tried to connect")


def _block_network() -> None:
    socket.socket.connect = _no_network  # type: ignore[method-assign]
    socket.create_connection = _no_network
    socket.getaddrinfo = _no_network


def _patch_torch() -> None:
    # On a CPU build the sanitizer would hook every op and ask for CUDA streams: keep it
    # off while torch imports, then put the variable back for the script's own check.
    sanitizer = os.environ.pop("TORCH_CUDA_SANITIZER", None)
    import torch

    if sanitizer is not None:
        os.environ["TORCH_CUDA_SANITIZER"] = sanitizer
    cuda: Any = torch.cuda
    cuda.is_available = lambda: True
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.get_device_name = lambda device=None: GPU_NAME
    cuda.get_device_capability = lambda device=None: (9, 0)
    cuda.synchronize = lambda device=None: None


def _pytest(args: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="standin_cases_") as folder:
        return _pytest_in(Path(folder), args)


def _pytest_in(cases: Path, args: list[str]) -> int:
    import pytest

    outcome = "False" if os.environ.get("STANDIN_CUDA_TESTS") == "fail" else "True"
    (cases / "test_core_standin.py").write_text(CORE_CASES.format(outcome=outcome))
    (cases / "test_optional_standin.py").write_text(OPTIONAL_OK)
    (cases / "test_broken_import_standin.py").write_text(OPTIONAL_BROKEN)
    rewritten: list[str] = []
    for arg in args:
        if arg == "tests/gpu/test_cuda.py":
            rewritten.append(str(cases / "test_core_standin.py"))
        elif arg == "tests":
            rewritten += [
                str(cases / "test_optional_standin.py"),
                str(cases / "test_broken_import_standin.py"),
            ]
        elif not arg.startswith("--ignore="):
            rewritten.append(arg)
    marker = ["-o", "markers=cuda: stand-in"]
    return int(pytest.main(["--rootdir", str(cases), *marker, *rewritten]))


class CUDASanitizerErrors(Exception):  # named as torch's, matched by name
    """Stands in for ``torch.cuda._sanitizer.CUDASanitizerErrors``."""


def _sanitizer(args: list[str]) -> int:
    from scripts import sanitizer_check as check

    def train(
        case: Any, device: Any, steps: int, dtype: Any, backend: Any = None, **options: Any
    ) -> str:
        if backend is not None:  # only the broken wrappers pass their own backend
            raise CUDASanitizerErrors("stand-in: CSAN detected a possible data race")
        split = ", with the split" if options.get("split") else ""
        return f"{case.name}{split}: {steps} steps (stand-in)"

    def toy_race(device: Any) -> None:
        raise CUDASanitizerErrors("stand-in: CSAN detected a possible data race")

    check.train = train  # type: ignore[assignment]
    check.toy_race = toy_race
    check.probe_record_stream = lambda device: False
    return check.main(args)


def _side(median: float) -> dict[str, Any]:
    return {
        "median_ms": median,
        "p10_ms": median * 0.9,
        "p90_ms": median * 1.1,
        "samples_per_s": 1000 / median,
        "peak_memory_bytes": 1 << 20,
        "peak_reserved_bytes": 2 << 20,
        "warmup_ms": [median * 10],
        "first_steps_ms": [median * 100],
        "final_loss": 1.0,
    }


def _suite(args: list[str]) -> int:
    from benchmarks import suite

    fail_batch = int(os.environ.get("STANDIN_FAIL_BATCH", "0"))
    fail_capture = os.environ.get("STANDIN_FAIL_CAPTURE", "")
    medians = {
        "plain": 2.0,
        "wrapped": 1.6,
        "wrapped_overlap": 1.5,
        "wrapped_tuned": 1.6,
        "wrapped_split": 1.7,
        "plain_graphed": 1.0,
        "wrapped_graphed": 0.8,
    }

    def measure_point(point: Any, device: Any, **kwargs: Any) -> dict[str, Any]:
        if point.batch == fail_batch:
            raise RuntimeError("stand-in failure")
        modes = list(kwargs["modes"])
        record: dict[str, Any] = {
            "model": point.spec.family,
            "label": point.spec.label,
            "size": point.spec.size,
            "batch": point.batch,
            "dtype": point.dtype,
            "planner": kwargs.get("planner"),
            "modes": modes,
            "failed_modes": {},
            "out_of_memory_modes": [],
            "speedups": {},
            "memory_ratio": 1.0,
            "reserved_ratio": 1.0,
        }
        for mode in modes:
            if mode.endswith("_graphed") and point.spec.family == fail_capture:
                record["failed_modes"][mode] = (
                    "OOOError: capturing the step in a CUDA graph failed (stand-in)"
                )
                continue
            side = record[mode] = _side(medians[mode])
            if mode != "plain":
                record["speedups"][mode] = medians["plain"] / medians[mode]
            if mode.endswith("_graphed"):
                side.update(captured=True, capture_ms=50.0, graph_warmup_ms=30.0)
            if mode.startswith("wrapped"):
                side.update(active=True, events=[], stages=8, streams=4)
            if mode == "wrapped_graphed":
                side.update(
                    capture_stage_calls=8, capture_bypasses=0, wrapper_in_capture="side streams"
                )
            elif mode.startswith("wrapped"):
                side["stats_per_step"] = {"waits": 8, "record_streams": 16}
                if mode == "wrapped_split":
                    side["stats_per_step"]["split_layer_calls"] = 12
            if mode == "wrapped_tuned":
                side["tuning"] = {
                    "decision": "static",
                    "device": "stand-in",
                    "speedup": 1.25,
                    "why": "faster than plain in the race and confirmed alone",
                    "arms": {
                        "plain": {"median_ms": 2.0, "step_ms": [2.0] * 6},
                        "static": {"median_ms": 1.6, "step_ms": [1.6] * 6},
                    },
                }
                side["tuning_steps"] = 15
        record["speedup"] = record["speedups"]["wrapped"]
        graphed = [record.get(m, {}).get("median_ms") for m in ("plain_graphed", "wrapped_graphed")]
        record["graphed_speedup"] = graphed[0] / graphed[1] if None not in graphed else None
        return record

    suite.measure_point = measure_point  # type: ignore[assignment]
    suite.calibrate.measure = lambda device=None, **kwargs: {
        "device": GPU_NAME,
        "sm_count": 132,
        "launch_us": 4.0,
        "kernel_floor_us": 1.5,
        "fork_join_us": 12.0,
        "concurrent_gemms": [
            {
                "shape": "1024x512 @ 512x2048",
                "dtype": "float32",
                "calls_per_stream": 20,
                "serial_ms": 1.5,
                "concurrent_ms": 1.4,
                "measured_overlap": 1.5 / 1.4,
                "estimated_overlap": 1.03,
                "estimated_occupancy": 1.0,
            }
        ],
    }
    suite.overhead.measure = lambda repeats, calls: {
        "plain_us_per_forward": 70.0,
        "wrapped_us_per_forward": 150.0,
        "added_us_per_stage_call": 3.3,
    }
    return suite.main(args)


def main(argv: list[str]) -> int:
    """Stand in for ``python3 argv...``; returns the exit status."""
    _block_network()
    sys.path.insert(0, str(ROOT))
    if argv and argv[0] == "scripts/gpu_kit.py":
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
        return 0
    if argv[:2] == ["-m", "pytest"]:
        return _pytest(argv[2:])  # the stand-in cases need no torch: spare its import
    _patch_torch()
    if argv == ["-"]:
        exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})
        return 0
    if argv and argv[0] == "scripts/sanitizer_check.py":
        return _sanitizer(argv[1:])
    if argv and argv[0] == "benchmarks/suite.py":
        return _suite(argv[1:])
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
