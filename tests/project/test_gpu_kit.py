"""Dry runs of ``scripts/gpu_check.sh`` on a CPU, and the kit's verdicts.

The kit runs with ``PYTHON`` pointing at ``tests/support/gpu_standin.py`` (a stand-in for the GPU
machine's ``python3``: CUDA reported present, network blocked, each program's GPU work
replaced), so every branch of the shell script runs here: the 8-file limit on ``$OUT``,
full and ``--quick`` modes, steps not started for lack of time, the optional step skipped,
a failing benchmark point kept.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ooo_wrap
from scripts import gpu_kit

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
MAX_FILES = 8  # what comes back from the GPU machine's $OUT


def _kit(tmp_path: Path, *args: str, **env: str) -> tuple[int, Path, str]:
    """Run the kit against the stand-in; returns its status, its $OUT and its output."""
    python = tmp_path / "python3"
    python.write_text(
        f'#!/bin/sh\nexec "{sys.executable}" "{ROOT}/tests/support/gpu_standin.py" "$@"\n'
    )
    python.chmod(0o755)
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), "PYTHON": str(python), **env}
    full_env.pop("PYTHONPATH", None)  # the kit must set it itself
    result = subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=400,
        cwd=tmp_path,
    )
    return result.returncode, out, result.stdout + result.stderr


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


def _rows(summary: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in summary.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith(("preflight", "(")):
            rows[cells[0]] = (cells[1], cells[2])
    return rows


def test_full_dry_run_keeps_a_failing_point_and_at_most_eight_files(tmp_path: Path) -> None:
    # GIT_DIR pointing nowhere: a checkout copied without .git, as on the GPU machine.
    no_git = {"GIT_DIR": str(tmp_path / "no-git"), "OOO_WRAP_COMMIT": "abc1234"}
    failing = {"STANDIN_FAIL_BATCH": "64", "STANDIN_FAIL_CAPTURE": "transformer"}
    status, out, output = _kit(tmp_path, **failing, **no_git)
    files = _files(out)
    assert len(files) <= MAX_FILES, files
    assert {f.split("_")[0] for f in files} == {"benchmark", "gpu", "reference", "summary.md"}
    assert [f for f in files if f.endswith((".json", ".png"))] == [
        f for f in files if f.startswith(("benchmark_", "reference_gpu_"))
    ]
    # The floors measured on the device, as a ReferenceGPU that plan()/check() take.
    (reference,) = out.glob("reference_gpu_*.json")
    gpu = ooo_wrap.ReferenceGPU.load(reference)
    assert (gpu.launch_us, gpu.kernel_floor_us, gpu.fork_join_us) == (4.0, 1.5, 12.0)
    assert gpu.name.startswith("Stand-in GPU (CPU dry run) (measured launch")
    assert gpu.peak_flops == ooo_wrap.H200.peak_flops
    summary = (out / "summary.md").read_text()
    # The concurrent-GEMM measurement (the stand-in's figures), next to the estimate.
    assert "| 1024x512 @ 512x2048 | float32 | 20 | 1.500 | 1.400 | 1.07x | 1.03x |" in summary
    rows = _rows(summary)
    assert rows["preflight"][0] == "PASS"
    assert rows["(a) tests/gpu/test_cuda.py"] == (
        "PASS",
        "2 passed, 0 failed or errored, 0 skipped (0 for lack of CUDA), pytest exit 0",
    )
    sanitizer = rows["(b) CUDA Stream Sanitizer"]
    assert sanitizer[0] == "PASS"
    assert "12/12 clean runs silent, 3/3 broken runs flagged" in sanitizer[1]
    assert "record_stream counted as a write" in sanitizer[1]
    # The failing points fail the step, and every other point is still in the table; each
    # point is measured twice, with the learned plan and with the static one: 4 families,
    # 14 points per precision. The transformer's graphed modes fail to capture: each is
    # a failure of its own, and the point's other modes are still measured.
    bench = rows["(c) benchmark suite"]
    assert bench[0] == "FAIL"
    assert "48 of 56 points measured, 8 failed, 24 modes of measured points failed" in bench[1]
    (json_path,) = out.glob("benchmark_*.json")
    data = json.loads(json_path.read_text())
    assert len(data["results"]) == 48 and len(data["errors"]) == 8 + 24 and data["complete"]
    assert "FAILED points:\n- towers K=8 W=2048 D=4 batch=64 float32" in summary
    for planner in ("dataflow", "static"):
        assert summary.count(f"| towers K=8 W=2048 D=4 [{planner}] | 16 | float32 | 2.000") == 1
    _assert_every_mode_measured(data, summary, float32_points=24, budget_s=110)
    assert {r["model"] for r in data["results"]} == {"towers", "branches", "transformer", "fanout"}
    failed = "transformer L=4 d=64 h=4 T=32 batch=8 float32 planner=dataflow [plain_graphed]"
    error = "OOOError: capturing the step in a CUDA graph failed (stand-in)"
    assert f"- {failed}: {error}" in summary
    assert summary.count(f"**FAILED: {error}**") == 24
    # An import error in one module does not take the optional step down.
    optional = rows["(d) other cuda tests (optional)"]
    assert optional[0] == "FAIL" and optional[1].startswith("1 passed, 1 failed or errored")
    assert summary.rstrip().endswith("RESULT: FAILED") and status == 1
    log = (out / "gpu_check.log").read_text()
    assert "pip " not in log and "install" not in log.replace("installs nothing", "")
    assert "has no network" not in output  # the stand-in blocks sockets; nothing tried
    assert "git abc1234;" in summary and data["environment"]["git_commit"] == "abc1234"


def test_quick_dry_run_passes_with_three_points_and_no_optional_step(tmp_path: Path) -> None:
    status, out, output = _kit(tmp_path, "--quick")
    assert status == 0, output
    assert len(_files(out)) <= MAX_FILES
    summary = (out / "summary.md").read_text()
    rows = _rows(summary)
    assert [r[0] for r in rows.values()] == ["PASS", "PASS", "PASS", "PASS", "NOT RUN"]
    assert rows["(d) other cuda tests (optional)"] == ("NOT RUN", "--quick")
    assert "4/4 clean runs silent" in rows["(b) CUDA Stream Sanitizer"][1]
    # Three points, each with the learned plan and with the static one, in every mode.
    assert rows["(c) benchmark suite"][1].startswith(
        "6 of 6 points measured, 0 failed, 0 modes of measured points failed"
    )
    (json_path,) = out.glob("benchmark_*.json")
    data = json.loads(json_path.read_text())
    assert [r["label"] for r in data["results"][::2]] == [
        "towers K=8 W=2048 D=4",
        "transformer L=4 d=64 h=4 T=32",
        "fanout N=16 W=128 D=2",
    ]
    assert data["settings"]["steps"] == 15 and data["settings"]["warmup"] == 3
    _assert_every_mode_measured(data, summary, float32_points=6, budget_s=25)
    assert len(list(out.glob("reference_gpu_*.json"))) == 1
    assert "(quick)" in summary
    assert summary.rstrip().endswith("RESULT: every required check passed")


MODES = [
    "plain",
    "wrapped",
    "wrapped_overlap",
    "wrapped_tuned",
    "wrapped_split",
    "plain_graphed",
    "wrapped_graphed",
]


def _assert_every_mode_measured(
    data: dict[str, object], summary: str, *, float32_points: int, budget_s: float
) -> None:
    """The kit asked for every mode, within the step's time budget, and the summary shows each."""
    settings = data["settings"]
    assert isinstance(settings, dict) and settings["modes"] == MODES
    assert 5 <= settings["budget_s"] <= budget_s  # new points stop within the step's limit
    assert f"Modes measured at every point: {', '.join(MODES)}" in summary
    for mode in MODES:  # a row per measured point and mode, a failed one included
        rows = [line for line in summary.splitlines() if f" | float32 | {mode} | " in line]
        assert len(rows) == float32_points, (mode, len(rows))
    fanout = "| fanout N=16 W=128 D=2 [dataflow] | 256 | float32 | wrapped_graphed | 0.800"
    (row,) = [line for line in summary.splitlines() if line.startswith(fanout)]
    assert "| 2.500x |" in row
    assert "stages on side streams inside the capture (8 stage calls forked)" in row
    assert "speedup vs plain_graphed 1.250x" in row
    split = "| fanout N=16 W=128 D=2 [dataflow] | 256 | float32 | wrapped_split | 1.700"
    (row,) = [line for line in summary.splitlines() if line.startswith(split)]
    assert "8 waits / 16 record_streams; 12 split layer calls" in row


def test_steps_without_time_left_are_not_run_not_failed(tmp_path: Path) -> None:
    status, out, output = _kit(tmp_path, GPU_CHECK_BUDGET_S="20", GPU_CHECK_OPTIONAL="0")
    summary = (out / "summary.md").read_text()
    rows = _rows(summary)
    assert [result for result, _ in rows.values()] == ["PASS", *["NOT RUN"] * 4], rows
    assert "of the 20s budget left; it needs 30s" in rows["(c) benchmark suite"][1]
    assert rows["(d) other cuda tests (optional)"][1] == "GPU_CHECK_OPTIONAL=0"
    assert "RESULT: INCOMPLETE" in summary and status == 3, output
    assert _files(out) == ["gpu_check.log", "summary.md"]  # no JSON: the suite never ran


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path of the script")
def test_gpu_check_stops_at_once_without_a_gpu(tmp_path: Path) -> None:
    # The kit must run the interpreter it is given (this one), not whatever `python` is
    # first on PATH: put a broken one there.
    decoy = tmp_path / "bin"
    decoy.mkdir()
    (decoy / "python").write_text("#!/bin/sh\necho 'wrong python on PATH' >&2\nexit 3\n")
    (decoy / "python").chmod(0o755)
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PYTHON": sys.executable,
        "PATH": f"{decoy}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode != 0
    assert "no CUDA GPU" in result.stdout + result.stderr
    assert "wrong python on PATH" not in result.stdout + result.stderr
    assert "stopped before running anything" in (tmp_path / "gpu_check.log").read_text()
    summary = (tmp_path / "summary.md").read_text()
    rows = _rows(summary)
    assert rows["preflight"][0] == "FAIL" and "no CUDA GPU" in rows["preflight"][1]
    assert summary.rstrip().endswith("RESULT: FAILED")


def test_gpu_check_script_parses() -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_unknown_argument_is_refused_and_help_is_the_header() -> None:
    result = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True)
    assert result.returncode == 2 and "unknown argument '--fast'" in result.stderr
    result = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("GPU validation kit")
    assert result.stdout.rstrip().endswith("GPU_CHECK_OPTIONAL=0 skips d.")


def _junit(tmp_path: Path, cases: str) -> Path:
    path = tmp_path / "report.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')
    return path


def test_junit_verdict_matches_the_skip_reason_exactly(tmp_path: Path) -> None:
    skip = '<testcase name="t{i}"><skipped message="{reason}"/></testcase>'
    passed = '<testcase name="ok"/>'
    no_cuda = _junit(tmp_path, passed + skip.format(i=1, reason=gpu_kit.NO_CUDA_REASON))
    verdict, line = gpu_kit.junit_verdict(no_cuda, 0)
    assert verdict == gpu_kit.FAIL and "(1 for lack of CUDA)" in line
    other = _junit(tmp_path, passed + skip.format(i=1, reason="needs 2 GPUs; no cuda device"))
    verdict, line = gpu_kit.junit_verdict(other, 0)
    assert verdict == gpu_kit.PASS and "1 skipped (0 for lack of CUDA)" in line


def test_junit_verdict_for_failures_interruptions_and_missing_reports(tmp_path: Path) -> None:
    ok = '<testcase name="ok"/>'
    failed = '<testcase name="bad"><failure message="x"/></testcase>'
    broken_import = '<testcase name="mod"><error message="collection failure"/></testcase>'
    assert gpu_kit.junit_verdict(_junit(tmp_path, ok), 0)[0] == gpu_kit.PASS
    assert gpu_kit.junit_verdict(_junit(tmp_path, ok + failed), 1)[0] == gpu_kit.FAIL
    assert gpu_kit.junit_verdict(_junit(tmp_path, ok + broken_import), 1)[0] == gpu_kit.FAIL
    verdict, line = gpu_kit.junit_verdict(_junit(tmp_path, ok), 2)
    assert verdict == gpu_kit.PARTIAL and "stopped at its time limit" in line
    assert gpu_kit.junit_verdict(_junit(tmp_path, ""), 0)[0] == gpu_kit.FAIL  # nothing ran
    assert gpu_kit.junit_verdict(tmp_path / "missing.xml", 4) == (
        gpu_kit.FAIL,
        "no junit report (pytest exit 4)",
    )


def test_the_real_cuda_tests_skipped_here_are_a_fail(tmp_path: Path) -> None:
    # What pytest really writes when conftest skips the cuda tests: the exact reason.
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the cuda tests run rather than skip")
    report = tmp_path / "cuda.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu/test_cuda.py",
         f"--junitxml={report}"],
        cwd=ROOT, capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    verdict, line = gpu_kit.junit_verdict(report, 0)
    assert verdict == gpu_kit.FAIL and "0 passed" in line and "for lack of CUDA)" in line
    skipped = int(line.split(" skipped (")[0].rsplit(" ", 1)[1])
    assert f"({skipped} for lack of CUDA)" in line and skipped > 10


def test_bench_verdict(tmp_path: Path) -> None:
    path = tmp_path / "b.json"

    def verdict(status: int = 0, **report: object) -> tuple[int, str]:
        base = {"results": [{}], "points_planned": 1, "complete": True}
        path.write_text(json.dumps({**base, **report}))
        return gpu_kit.bench_verdict(path, status)

    assert verdict()[0] == gpu_kit.PASS
    assert verdict(errors=["p: boom"])[0] == gpu_kit.FAIL
    mode = verdict(errors=["p planner=static [plain_graphed]: OOOError: x", "q: boom"])
    assert mode[0] == gpu_kit.FAIL  # a mode that could not be captured fails the step too
    assert "1 failed, 1 modes of measured points failed" in mode[1]
    assert verdict(fallbacks=["p: DISABLED/cpu"])[0] == gpu_kit.FAIL  # a fallback is no pass
    oom = verdict(out_of_memory=["p"], results=[{}, {}])
    assert oom[0] == gpu_kit.PASS and "1 out of memory" in oom[1]
    assert verdict(results=[])[0] == gpu_kit.FAIL
    partial = verdict(130, complete=False)
    assert partial[0] == gpu_kit.PARTIAL and "INCOMPLETE" in partial[1]
    assert gpu_kit.bench_verdict(tmp_path / "none.json", 2)[0] == gpu_kit.FAIL
