"""The benchmark code paths that run on a CPU: models, measurement loop, reports, CPU-only mode.

Speed is never asserted here (the CPU numbers mean nothing for the GPU); the structure of
what the suite measures and writes is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import ooo_wrap
import ooo_wrap.testing
from benchmarks import overhead, report, suite
from benchmarks.measure import MODES, Point, measure_point, summarize_times
from benchmarks.models import ModelSpec
from ooo_wrap.testing import SimulatedBackend
from ooo_wrap.testing._detect import DetectingBackend
from ooo_wrap.testing._simulated import DEFAULT_STREAM, StreamCall
from scripts import sanitizer_check

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")

SMALL = {
    "towers": ModelSpec.towers(3, 16, 2),
    "branches": ModelSpec.branches(4, 4, 2, 8),
    "transformer": ModelSpec.transformer(2, 16, 2, 8),
    "fanout": ModelSpec.fanout(4, 8, 2),
}
# branches and fanout: their stem and head too
STAGES = {"towers": 3, "branches": 4 + 2, "transformer": 2, "fanout": 4 + 2}


@pytest.mark.parametrize("family", sorted(SMALL))
def test_models_build_train_and_plan(family: str) -> None:
    spec = SMALL[family]
    model = spec.build()
    x, y = spec.make_batch(2)
    loss = spec.loss(model(x), y)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None for p in model.parameters())
    assert len(ooo_wrap.plan(model, streams=4).stages) == STAGES[family]


@pytest.mark.parametrize("family", sorted(SMALL))
def test_one_seed_builds_one_model(family: str) -> None:
    a, b = SMALL[family].build(seed=3).state_dict(), SMALL[family].build(seed=3).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.parametrize("family", sorted(SMALL))
def test_models_pass_the_race_checker(family: str) -> None:
    # The CPU counterpart of the sanitizer run in gpu_check.sh: no races, bitwise parity,
    # with its static plan (at these sizes the dataflow planner finds no fork worth it
    # for some families, and a model that runs plain checks nothing).
    spec = SMALL[family]
    x, y = spec.make_batch(2)
    report = ooo_wrap.testing.check(
        spec.build(), x, loss_fn=lambda out: spec.loss(out, y), planner="static"
    )
    assert report.ok, str(report)


def test_spec_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="width"):
        ModelSpec.towers(2, 0, 2)
    with pytest.raises(ValueError, match="unknown family"):
        ModelSpec("mlp", 1, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extent"):
        ModelSpec("branches", 1, 1, 1)


def test_summarize_times() -> None:
    summary = summarize_times([0.001 * i for i in range(1, 11)], batch=4)
    assert summary["median_ms"] == pytest.approx(5.5)
    assert summary["p10_ms"] == pytest.approx(1.9)
    assert summary["p90_ms"] == pytest.approx(9.1)
    assert summary["samples_per_s"] == pytest.approx(4 / 0.0055)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measure_point_on_cpu_with_virtual_streams(dtype: Any) -> None:
    spec = SMALL["towers"]
    record = measure_point(
        Point(spec, 2, dtype),
        CPU,
        warmup=2,
        steps=3,
        mem_steps=1,
        backend=SimulatedBackend(),
        planner="static",
    )
    assert record["model"] == "towers" and record["batch"] == 2 and record["dtype"] == dtype
    assert record["planner"] == "static"
    for side in ("plain", "wrapped"):
        s = record[side]
        assert len(s["warmup_ms"]) == 2 and len(s["first_steps_ms"]) == 1
        assert s["p10_ms"] <= s["median_ms"] <= s["p90_ms"]
        assert s["peak_memory_bytes"] is None  # measured on CUDA only
        assert s["peak_reserved_bytes"] is None
    wrapped = record["wrapped"]
    assert wrapped["active"] and wrapped["stages"] == 3 and wrapped["streams"] == 3
    # Per step: one forward, each tower one stage call and one wait, record_stream on its
    # input and its output, joins per stage call plus one per stream at the root.
    assert wrapped["stats_per_step"] == {
        "forwards": 1,
        "stage_calls": 3,
        "waits": 3,
        "record_streams": 6,
        "joins": 6,
        "bypasses": 0,
        "failures": 0,
        "split_layer_calls": 0,  # no tuning here, so no weight-gradient split by default
        "split_step_asides": 0,
    }
    assert record["memory_ratio"] is None and record["reserved_ratio"] is None
    assert wrapped["final_loss"] == record["plain"]["final_loss"]  # same math on the CPU


def test_measure_point_with_the_learned_plan_learns_in_warmup() -> None:
    record = measure_point(
        Point(SMALL["towers"], 2, "float32"),
        CPU,
        warmup=1,
        steps=2,
        mem_steps=1,
        backend=SimulatedBackend(),
    )
    wrapped = record["wrapped"]
    assert record["planner"] == "dataflow" and wrapped["active"]
    assert any("planned/learned" in event for event in wrapped["events"])
    learned_stages = wrapped["stages"]
    # Steady state after the warm-up step that learned: every stage call forks and joins.
    assert wrapped["stats_per_step"]["stage_calls"] == learned_stages
    assert wrapped["stats_per_step"]["forwards"] == (1 if learned_stages else 0)
    assert wrapped["final_loss"] == record["plain"]["final_loss"]


def test_the_suite_measures_both_planners_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def measure(point: Point, device: torch.device, **kwargs: Any) -> dict[str, Any]:
        seen.append(kwargs["planner"])
        record = fake_record("towers", TARGET, point.batch, 1.1)
        record["planner"] = kwargs["planner"]
        return record

    data, _ = _run(monkeypatch, "16,32", measure, planner="both")
    assert seen == ["dataflow", "static", "dataflow", "static"]
    assert [(r["batch"], r["planner"]) for r in data["results"]] == [
        (16, "dataflow"),
        (16, "static"),
        (32, "dataflow"),
        (32, "static"),
    ]
    assert "[dataflow]" in report.markdown_table(data["results"])


def test_measure_point_rejects_no_steps() -> None:
    with pytest.raises(ValueError, match="steps"):
        measure_point(Point(SMALL["towers"], 2, "float32"), CPU, steps=0)


def test_fallback_is_recorded_not_hidden() -> None:
    record = measure_point(Point(SMALL["towers"], 2, "float32"), CPU, warmup=0, steps=1)
    assert not record["wrapped"]["active"]  # a CPU model without a backend falls back
    assert any("disabled/cpu" in event for event in record["wrapped"]["events"])
    assert "not wrapped: disabled/cpu" in report.markdown_table([record])


def _side(median: float, peak: int | None) -> dict[str, Any]:
    return {
        "median_ms": median,
        "p10_ms": median * 0.9,
        "p90_ms": median * 1.1,
        "samples_per_s": 16 / (median / 1e3),
        "peak_memory_bytes": peak,
        "warmup_ms": [median * 10],
        "first_steps_ms": [median * 100],
        "final_loss": 1.0,
    }


def fake_record(
    model: str, size: dict[str, int], batch: int, speedup: float, memory_ratio: float = 1.0
) -> dict[str, Any]:
    """A record shaped like measure_point's, with chosen numbers."""
    wrapped = _side(2.0 / speedup, int(2**20 * memory_ratio))
    wrapped.update(
        active=True,
        events=[],
        stages=8,
        streams=4,
        stats_per_step={"waits": 8, "record_streams": 16},
    )
    return {
        "model": model,
        "label": f"{model} {size}",
        "size": size,
        "batch": batch,
        "dtype": "float32",
        "plain": _side(2.0, 2**20),
        "wrapped": wrapped,
        "speedup": speedup,
        "memory_ratio": memory_ratio,
        "reserved_ratio": memory_ratio * 1.5,
    }


TARGET = {"towers": 8, "width": 2048, "depth": 4}
TRANSFORMER = {"blocks": 4, "dim": 64, "heads": 4, "seq": 32}


def test_markdown_table_has_the_columns_and_a_row_per_record() -> None:
    records = [fake_record("towers", TARGET, 16, 1.25), fake_record("towers", TARGET, 64, 0.8)]
    lines = report.markdown_table(records).splitlines()
    assert len(lines) == 2 + len(records)
    header = lines[0]
    for column in ("plain ms median", "wrapped ms median", "speedup", "samples/s", "peak MiB"):
        assert column in header
    assert "waits / record_streams per step" in header
    assert "| 1.250x |" in lines[2] and "| 0.800x |" in lines[3]
    assert "| 8 / 16 |" in lines[2]
    assert lines[1].count("---") == header.count("|") - 1


def test_targets_are_reported_met_or_not() -> None:
    lines = report.targets_lines(
        [
            fake_record("towers", TARGET, 16, 1.4, memory_ratio=1.05),
            fake_record("towers", TARGET, 256, 0.9),
            fake_record("transformer", TRANSFORMER, 8, 0.95, memory_ratio=1.2),
        ]
    )
    text = "\n".join(lines)
    assert "measured 1.400x (met)" in text
    assert "0.900x" in text and "1.400x" in text  # the whole towers curve, low to high
    assert "worst 0.950x" in text and "(NOT met)" in text
    assert "worst 1.200x" in text
    assert "reserved by the allocator, for reference: worst 1.800x" in text
    missing = "\n".join(report.targets_lines([]))
    assert missing.count("not measured in this run") == 3


def test_cpu_only_run_is_honest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(suite, "gpu_available", lambda: False)
    status = suite.main(
        ["--out-dir", str(tmp_path), "--overhead-repeats", "2", "--overhead-calls", "5"]
    )
    assert status == 0
    out = capsys.readouterr().out
    assert "need a GPU and are not measured here" in out
    assert "| model |" not in out and " ms median" not in out  # no speed table at all
    assert "added per stage call" in out
    (path,) = tmp_path.glob("*_cpu-only.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "cpu-only" and data["results"] == []
    assert set(data["host_overhead"]) == {
        "plain_us_per_forward",
        "wrapped_us_per_forward",
        "added_us_per_stage_call",
    }
    assert data["environment"]["gpu"] is None
    assert not list(tmp_path.glob("*.png"))


def test_require_gpu_fails_without_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(suite, "gpu_available", lambda: False)
    assert suite.main(["--require-gpu"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_summarize_prints_an_earlier_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = {
        "kind": "gpu",
        "environment": suite.environment(["--steps", "30"]),
        "settings": suite._settings(suite.parse_args([])),
        "results": [fake_record("towers", TARGET, 16, 1.3)],
        "skipped": ["branches batch=256 bfloat16"],
        "out_of_memory": ["towers batch=4096 float32"],
        "errors": ["towers batch=64 float32: RuntimeError: boom"],
        "fallbacks": ["transformer batch=8 float32: DISABLED/cpu"],
        "host_overhead": {
            "plain_us_per_forward": 70.0,
            "wrapped_us_per_forward": 150.0,
            "added_us_per_stage_call": 3.3,
        },
    }
    path = report.write_json(data, tmp_path / "sub" / "r.json")
    assert suite.main(["--summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| model |" in out and "measured 1.300x (met)" in out
    assert "Not measured (time budget spent):\n- branches batch=256 bfloat16" in out
    assert "Out of memory on this GPU (a limit of the GPU, not a failure):\n- towers" in out
    assert "FAILED points:\n- towers batch=64 float32: RuntimeError: boom" in out
    assert "FELL BACK (the wrapper was not active, so not a pass):\n- transformer" in out
    assert "INCOMPLETE" not in out  # an older file without the field is not called partial
    assert "3.30 µs" in out


def _fake_measure(point: Point, device: torch.device, **kwargs: Any) -> dict[str, Any]:
    """measure_point's stand-in: batch 64 runs out of memory, 256 raises, 32 falls back."""
    if point.batch == 64:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    if point.batch == 256:
        raise RuntimeError("boom")
    record = fake_record("towers", TARGET, point.batch, 1.1)
    if point.batch == 32:
        record["wrapped"].update(active=False, events=["DISABLED/cpu"])
    return record


def _run(
    monkeypatch: pytest.MonkeyPatch,
    batches: str,
    measure: Any = _fake_measure,
    planner: str = "static",
    **kwargs: Any,
) -> tuple[dict[str, Any], argparse.Namespace]:
    monkeypatch.setattr(suite, "measure_point", measure)
    env = {"date_utc": "2026-12-01T07:00:00+00:00", "gpu": "test", "torch": "2.11.0"}
    env.update(ooo_wrap="0.1.0", command="python benchmarks/suite.py")
    monkeypatch.setattr(suite, "environment", lambda argv: env)
    monkeypatch.setattr(suite.overhead, "measure", lambda repeats, calls: dict(HOST))
    flags = f"--models towers --dtypes float32 --towers-widths 2048 --towers-batches {batches}"
    args = suite.parse_args([*flags.split(), "--planner", planner])
    return suite.run_gpu(args, [], device=CPU, **kwargs), args


HOST = {
    "plain_us_per_forward": 70.0,
    "wrapped_us_per_forward": 150.0,
    "added_us_per_stage_call": 3.3,
}


def test_a_failing_point_is_reported_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = _run(monkeypatch, "16,64,256,32")
    assert [r["batch"] for r in data["results"]] == [16, 32]
    assert data["out_of_memory"] == ["towers K=8 W=2048 D=4 batch=64 float32"]
    assert data["errors"] == ["towers K=8 W=2048 D=4 batch=256 float32: RuntimeError: boom"]
    assert data["fallbacks"] == ["towers K=8 W=2048 D=4 batch=32 float32: DISABLED/cpu"]
    assert data["skipped"] == [] and data["complete"] and data["points_planned"] == 4
    assert "FAILED: RuntimeError: boom" in capsys.readouterr().err


def test_the_json_is_written_after_every_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "run.json"
    seen: list[tuple[int, bool]] = []

    def spy(point: Point, device: torch.device, **kwargs: Any) -> dict[str, Any]:
        if path.exists():  # what a run killed now would leave behind
            data = json.loads(path.read_text())
            seen.append((len(data["results"]) + len(data["errors"]), data["complete"]))
        return _fake_measure(point, device, **kwargs)

    _run(monkeypatch, "16,256,16", measure=spy, json_path=path)
    assert seen == [(0, False), (1, False), (2, False)]
    final = json.loads(path.read_text())
    assert final["complete"] and len(final["results"]) == 2 and len(final["errors"]) == 1
    partial = dict(final, complete=False, host_overhead=None)
    text = report.render_report(partial)
    assert "INCOMPLETE: the run stopped after 3 of 3 points" in text
    assert "Host overhead of the hooks: not measured" in text


def test_estimates_are_recorded_next_to_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    data, _ = _run(monkeypatch, "16")
    none = {"plain_ms": None, "wrapped_ms": None, "source": None}
    assert data["results"][0]["estimate"] == none  # no cost model wired in: same shape

    def model(point: Point) -> tuple[float, float] | None:
        return (2.0, 1.5) if point.batch == 16 else None

    data, _ = _run(monkeypatch, "16,128", estimator=model)
    first, second = (r["estimate"] for r in data["results"])
    assert first["plain_ms"] == 2.0 and first["wrapped_ms"] == 1.5
    assert "model" in first["source"]
    assert second == none
    table = report.markdown_table(data["results"])
    assert "estimated ms plain / wrapped (cost model, not measured)" in table
    assert "| 2.000 / 1.500 |" in table and table.rstrip().endswith("| n/a |")
    assert "cost model" not in report.markdown_table([fake_record("towers", TARGET, 16, 1.0)])


def _pretend_gpu(monkeypatch: pytest.MonkeyPatch, measure: Any) -> None:
    monkeypatch.setattr(suite, "gpu_available", lambda: True)
    monkeypatch.setattr(suite, "measure_point", measure)
    monkeypatch.setattr(suite.overhead, "measure", lambda repeats, calls: dict(HOST))
    monkeypatch.setattr(suite.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(suite.torch.cuda, "get_device_name", lambda index=None: "Stand-in")
    monkeypatch.setattr(suite.torch.cuda, "get_device_capability", lambda index=None: (9, 0))


FLAGS = [
    "--planner",
    "static",
    "--models",
    "towers",
    "--dtypes",
    "float32",
    "--towers-widths",
    "2048",
    "--towers-batches",
]


def test_a_fallback_or_a_failure_fails_the_run_but_keeps_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _pretend_gpu(monkeypatch, _fake_measure)
    path = tmp_path / "r.json"
    assert suite.main([*FLAGS, "16,32", "--json", str(path), "--no-plot"]) == 1
    data = json.loads(path.read_text())
    assert [r["batch"] for r in data["results"]] == [16, 32] and data["fallbacks"]
    assert "0 points failed and 1 fell back" in capsys.readouterr().err


def test_an_interrupted_run_keeps_its_points_json_and_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(point: Point, device: torch.device, **kwargs: Any) -> dict[str, Any]:
        if point.batch == 8:
            raise KeyboardInterrupt  # what SIGINT from the kit's time limit raises
        return _fake_measure(point, device, **kwargs)

    _pretend_gpu(monkeypatch, interrupted)
    path = tmp_path / "r.json"
    assert suite.main([*FLAGS, "16,8,128", "--json", str(path)]) == 130
    data = json.loads(path.read_text())
    assert data["interrupted"] and not data["complete"] and data["host_overhead"] is None
    assert [r["batch"] for r in data["results"]] == [16]
    assert path.with_suffix(".png").exists()
    out = capsys.readouterr().out
    assert "INCOMPLETE: the run stopped after 1 of 3 points" in out
    assert "Host overhead of the hooks: not measured" in out


def test_commit_comes_from_the_environment_without_git(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_git(*args: Any, **kwargs: Any) -> Any:
        raise subprocess.CalledProcessError(128, "git")

    monkeypatch.setattr(suite.subprocess, "run", no_git)
    monkeypatch.delenv(suite.COMMIT_VARIABLE, raising=False)
    assert suite._git_commit() is None
    monkeypatch.setenv(suite.COMMIT_VARIABLE, "abc1234")
    assert suite._git_commit() == "abc1234"


def test_default_sweep_starts_at_the_target_point() -> None:
    points = suite.build_points(suite.parse_args([]))
    assert points[0] == Point(ModelSpec.towers(8, 2048, 4), 16, "float32")
    # per dtype: towers batch + width, branches, transformer, fanout
    assert len(points) == 2 * (3 + 3 + 3 + 3 + 2)
    assert [p.dtype for p in points[:12]] == ["float32"] * 12
    widths = {p.spec.width for p in points if p.spec.family == "towers"}
    assert widths == {512, 1024, 2048, 4096}


def test_bad_flags_are_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        suite.parse_args(["--models", "towers,resnet"])
    assert "resnet" in capsys.readouterr().err


def test_output_name_has_date_and_gpu() -> None:
    env = {"date_utc": "2026-11-30T04:15:09+00:00", "gpu": "NVIDIA H200"}
    assert suite.output_stem(env) == "2026-11-30T0415Z_nvidia-h200"


def test_plot_is_skipped_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    records = [fake_record("towers", TARGET, 16, 1.2)]
    assert report.write_plot(records, tmp_path / "p.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_plot_is_written_with_matplotlib(tmp_path: Path) -> None:
    narrow = {**TARGET, "width": 512}
    records = [
        fake_record("towers", TARGET, 16, 1.2),
        fake_record("towers", TARGET, 64, 1.1),
        fake_record("towers", narrow, 16, 1.4),
        fake_record("transformer", TRANSFORMER, 8, 0.98),
    ]
    path = report.write_plot(records, tmp_path / "p.png")
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"


def test_sanitizer_check_refuses_to_run_without_a_gpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sanitizer_check.main([]) == sanitizer_check.EXIT_SETUP
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_sanitizer_cases_cover_every_family() -> None:
    names = " ".join(case.name for case in sanitizer_check.cases())
    for family in ("towers", "branches", "transformer", "quickstart"):
        assert family in names
    quick = [case.name for case in sanitizer_check.cases(quick=True)]
    assert len(quick) == 2 and "towers" in quick[0] and "transformer" in quick[1]


@pytest.mark.parametrize("broken", [False, True])
def test_the_wrapper_without_its_fork_wait_is_a_race_the_cpu_detector_sees(broken: bool) -> None:
    # The broken-wrapper mode that the sanitizer must flag on a GPU, checked here by the CPU
    # race detector: removing the fork wait is a real race, and nothing else is removed.
    backend_class = DetectingBackend
    if broken:
        backend_class = sanitizer_check.without_fork_wait(DetectingBackend)
    spec = SMALL["towers"]
    x, y = spec.make_batch(2)
    with ooo_wrap.testing.detect(backend_class()) as found:
        model = ooo_wrap.OOOModule(spec.build(), streams=3, backend=found.backend, planner="static")
        found.keep_alive(model)
        spec.loss(model(x), y).backward()
    waits = [call for call in found.backend.log if call.op == "wait_event"]
    side_waits = [call for call in waits if call.stream != DEFAULT_STREAM]
    if broken:
        assert found.races, "removing the fork wait must be a race"
        assert not side_waits and len(waits) == 3 + 3  # the joins are all still there
    else:
        assert not found.races and not found.allocator_hazards
        assert len(side_waits) == 3


@pytest.mark.parametrize("broken", [False, True])
def test_the_split_without_its_dw_wait_is_a_race_the_cpu_detector_sees(broken: bool) -> None:
    # The sanitizer's broken split run, checked here by the CPU race detector: on the
    # chain (its plan the split alone), the broken backend drops exactly the weight-
    # gradient stream's wait for the layer's output gradient, one per layer, and that is
    # a race; the layers' stream still catches up with each dW.
    backend_class = DetectingBackend
    if broken:
        backend_class = sanitizer_check.without_fork_wait(DetectingBackend)
    case = sanitizer_check.split_chain()
    x, y = case.batch(torch.device("cpu"))
    with ooo_wrap.testing.detect(backend_class()) as found:
        model = ooo_wrap.OOOModule(
            case.build(), backend=found.backend, split_weight_grads=True, tune=False
        )
        found.keep_alive(model)
        for _ in range(2):  # the first step learns, inline; the second splits
            case.loss(model(x), y).backward()
            found.keep_alive(*(p.grad for p in model.parameters()))
    assert model.plan.stages == () and model.stats.split_layer_calls == 4
    waits = [call for call in found.backend.log if call.op == "wait_event"]
    on_w = [call for call in waits if call.stream != DEFAULT_STREAM]
    assert len(waits) - len(on_w) == 4  # the layers' stream catches up with each dW
    if broken:
        assert found.races, "removing the dW wait must be a race"
        assert on_w == []
    else:
        assert not found.races and not found.allocator_hazards
        assert len(on_w) == 4


class CUDASanitizerErrors(Exception):  # named as torch's private class, matched by name
    pass


@pytest.mark.parametrize("failure", [None, "clean run reported", "broken run not flagged"])
def test_sanitizer_check_verdict(
    failure: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The GPU work replaced: what the sanitizer would raise, and where.
    def train(
        case: Any, device: Any, steps: int, dtype: Any, backend: Any = None, **options: Any
    ) -> str:
        runs.append((case.name, options.get("split", False), backend is not None))
        reported = (
            failure == "clean run reported"
            and case.name.startswith("towers")
            and not options.get("split")
        )
        if backend is not None or reported:
            raise CUDASanitizerErrors("CSAN detected a possible data race")
        return case.name

    def toy_race(device: Any) -> None:
        if failure != "broken run not flagged":
            raise CUDASanitizerErrors("CSAN detected a possible data race")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setenv("TORCH_CUDA_SANITIZER", "1")
    monkeypatch.setattr(sanitizer_check, "train", train)
    monkeypatch.setattr(sanitizer_check, "toy_race", toy_race)
    monkeypatch.setattr(sanitizer_check, "probe_record_stream", lambda device: True)
    runs: list[tuple[str, bool, bool]] = []  # model, with the split, a broken backend
    status = sanitizer_check.main(["--quick"])
    out = capsys.readouterr().out
    verdict = out.strip().splitlines()[-1]
    assert out.startswith("preflight: this sanitizer ignores record_stream")
    # Quick: the towers and the transformer, stages alone and with the split; then the
    # two broken wrappers (the toy race runs no model).
    names = [(name.split()[0], split, broken) for name, split, broken in runs]
    assert names == [
        ("towers", False, False),
        ("transformer", False, False),
        ("towers", True, False),
        ("transformer", True, False),
        ("towers", False, True),
        ("chain", True, True),
    ]
    if failure is None:
        assert status == 0 and verdict.startswith("verdict: PASS: 4/4 clean runs silent")
        assert "3/3 broken runs flagged" in verdict
    elif failure == "clean run reported":
        assert status == 1 and "REPORTED (must be silent): towers" in out
        assert verdict.startswith("verdict: FAIL: 3/4 clean runs silent, 3/3 broken")
    else:
        assert status == 1 and "NOT FLAGGED (must be): a two-stream program" in out
        assert "2/3 broken runs flagged" in verdict


def test_a_learned_no_parallelism_chain_makes_no_backend_call() -> None:
    result = overhead.measure_no_parallelism(repeats=3, calls=5, warmup=5)
    assert result["backend_calls_per_forward"] == 0
    assert result["plain_us_per_forward"] > 0 and result["wrapped_us_per_forward"] > 0
    assert result["plain_iqr_us"] >= 0


def measure_small(family: str, modes: Sequence[str]) -> dict[str, Any]:
    """``modes`` measured on the small ``family`` model at batch 2 on virtual streams, with
    the static plan: one warm-up step and two timed ones."""
    return measure_point(
        Point(SMALL[family], 2, "float32"),
        CPU,
        warmup=1,
        steps=2,
        mem_steps=1,
        backend=SimulatedBackend(),
        planner="static",
        modes=modes,
    )


def test_measure_point_with_overlap_forward_defers_the_joins() -> None:
    """The suite's --overlap-forward adds the mode beside wrapped; it reaches the wrapper."""
    args = suite.parse_args(["--overlap-forward"])
    assert args.modes == ["plain", "wrapped", "wrapped_overlap"]
    assert suite._settings(args)["overlap_forward"]
    record = measure_small("fanout", args.modes)
    wrapped, overlap = record["wrapped"], record["wrapped_overlap"]
    assert overlap["active"] and overlap["stats_per_step"]["stage_calls"] == 6
    # Eager joins: one wait per stage call. Deferred: the head's stream also waits on each
    # branch's pending join when it receives their outputs, so the stats tell them apart.
    assert wrapped["stats_per_step"]["waits"] == 6
    assert overlap["stats_per_step"]["waits"] == 6 + 4
    assert overlap["final_loss"] == record["plain"]["final_loss"] == wrapped["final_loss"]
    assert set(record["speedups"]) == {"wrapped", "wrapped_overlap"}


def test_measure_point_with_split_times_the_weight_gradient_split_arm() -> None:
    """--split adds wrapped_split beside wrapped: the same plan with every Linear's weight
    gradient on the weight-gradient stream, same losses as plain on the CPU."""
    args = suite.parse_args(["--split"])
    assert args.modes == ["plain", "wrapped", "wrapped_split"]
    record = measure_small("towers", args.modes)
    wrapped, split = record["wrapped"], record["wrapped_split"]
    layers = sum(isinstance(m, torch.nn.Linear) for m in SMALL["towers"].build().modules())
    assert split["active"] and split["stats_per_step"]["split_layer_calls"] == layers
    assert wrapped["stats_per_step"]["split_layer_calls"] == 0
    assert split["stats_per_step"]["stage_calls"] == wrapped["stats_per_step"]["stage_calls"]
    assert split["final_loss"] == record["plain"]["final_loss"] == wrapped["final_loss"]
    row = report.modes_table([record]).splitlines()[2:][-1]
    assert f"{layers:g} split layer calls" in row and " wrapped_split " in row


def test_measure_point_records_the_wrappers_tuning_beside_its_own_times() -> None:
    """--tuned adds wrapped_tuned: the wrapper's decision and medians sit beside the mode's
    interleaved times, so the two measurements can be compared."""
    args = suite.parse_args(["--tuned"])
    assert args.modes == ["plain", "wrapped", "wrapped_tuned"]

    def faster_with_side_streams(calls: Sequence[StreamCall]) -> float:
        return 8.0 if any(c.op == "set_stream" and c.stream.id for c in calls) else 10.0

    record = measure_point(
        Point(SMALL["towers"], 2, "float32"),
        CPU,
        warmup=1,
        steps=16,
        mem_steps=1,
        backend=SimulatedBackend(step_time=faster_with_side_streams),
        planner="static",
        modes=args.modes,
    )
    tuning = record["wrapped_tuned"]["tuning"]
    assert tuning["decision"] != "plain" and tuning["device"] == "simulated"
    assert tuning["arms"]["plain"]["median_ms"] == 10.0
    assert tuning["arms"][tuning["decision"]]["median_ms"] == 8.0
    assert tuning["speedup"] == pytest.approx(1.25)
    assert "tuning" not in record["wrapped"]  # the plan itself, never tuned
    # Tuned alone first (the race of four arms: a warm-up and 6 counted steps each; then
    # the confirmation round: 6 steps each of the winner and plain), then timed interleaved.
    assert record["wrapped_tuned"]["tuning_steps"] == 42
    assert record["wrapped_tuned"]["median_ms"] > 0


class _Replay:
    """What ``graphed_step`` returns when it captured: replays give back the captured
    step's (static) loss."""

    captured = True
    reason = "captured"
    message = "captured (simulated)"

    def __init__(self, output: torch.Tensor) -> None:
        self.output = output
        self.calls = 0

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.output


def _simulated_capture(backend: SimulatedBackend, *, inline: bool, seen: list[Any]) -> Any:
    """``graphed_step`` on virtual streams: ``warmup`` eager steps, then one step with the
    stream capturing (``backend.capturing()``). ``inline=True`` also runs that step inside
    ``ooo_wrap.disabled()``, so the wrapper runs its stage calls inline on the capturing
    stream. A real replay runs no Python, so neither does this one.
    """

    def capture(step_fn: Any, *args: torch.Tensor, warmup: int) -> _Replay:
        seen.append(warmup)
        for _ in range(warmup):
            step_fn(*args)
        with backend.capturing(), ooo_wrap.disabled() if inline else contextlib.nullcontext():
            return _Replay(step_fn(*args))

    return capture


@pytest.mark.parametrize("inline", [False, True])
def test_graphed_modes_record_where_the_wrapper_ran_its_stages_in_the_capture(
    inline: bool,
) -> None:
    backend = SimulatedBackend()
    seen: list[Any] = []
    record = measure_point(
        Point(SMALL["towers"], 2, "float32"),
        CPU,
        warmup=1,
        steps=2,
        mem_steps=1,
        backend=backend,
        planner="static",
        modes=["wrapped_graphed", "plain", "plain_graphed", "wrapped"],
        capture=_simulated_capture(backend, inline=inline, seen=seen),
        graph_warmup=2,
    )
    assert seen == [2] * 4  # two captures per graphed mode (memory phase, timing phase)
    assert record["modes"] == ["plain", "wrapped", "plain_graphed", "wrapped_graphed"]
    assert record["failed_modes"] == {} and record["out_of_memory_modes"] == []
    plain_graphed, wrapped_graphed = record["plain_graphed"], record["wrapped_graphed"]
    for side in (plain_graphed, wrapped_graphed):
        assert side["captured"] and side["capture_ms"] > 0 and side["graph_warmup_ms"] > 0
        assert len(side["warmup_ms"]) == 1 and len(side["first_steps_ms"]) == 1
    assert "capture_stage_calls" not in plain_graphed and "active" not in plain_graphed
    assert wrapped_graphed["active"] and wrapped_graphed["stages"] == 3
    assert "stats_per_step" not in wrapped_graphed  # replays run no hooks: nothing per step
    # Only the captured step is counted: the warm-up steps forked 3 stage calls each too.
    if inline:
        assert wrapped_graphed["capture_stage_calls"] == 0
        assert wrapped_graphed["capture_bypasses"] == 3
        assert wrapped_graphed["wrapper_in_capture"] == "inline"
        note = "stages inline in the capture, not overlapped (3 stage calls bypassed)"
    else:  # the wrapper: each of the 3 stage calls of the capture forked
        assert wrapped_graphed["capture_stage_calls"] == 3
        assert wrapped_graphed["capture_bypasses"] == 0
        assert wrapped_graphed["wrapper_in_capture"] == "side streams"
        note = "stages on side streams inside the capture (3 stage calls forked)"
    assert set(record["speedups"]) == {"wrapped", "plain_graphed", "wrapped_graphed"}
    assert record["graphed_speedup"] == pytest.approx(
        plain_graphed["median_ms"] / wrapped_graphed["median_ms"]
    )
    rows = report.modes_table([record]).splitlines()[2:]
    assert [row.split(" | ")[3] for row in rows] == record["modes"]
    assert note in rows[3] and "speedup vs plain_graphed" in rows[3]
    assert "captured in" in rows[2] and "ms of warm-up" in rows[2]
    assert "3 waits / 6 record_streams" in rows[1]


@pytest.mark.parametrize(
    ("stages", "forked", "inline", "where"),
    [
        (0, 0, 0, "no stages"),
        (3, 3, 0, "side streams"),
        (3, 0, 3, "inline"),
        (3, 2, 1, "partly inline"),
        (3, 0, 0, "no stage calls"),
    ],
)
def test_where_the_capture_ran_the_stages_follows_the_counters(
    stages: int, forked: int, inline: int, where: str
) -> None:
    from benchmarks import measure

    assert measure._where_in_capture(stages, forked, inline) == where
    side = {"wrapper_in_capture": where, "capture_stage_calls": forked, "capture_bypasses": inline}
    assert report._capture_note(side) != "capture not recorded"


def test_the_graphed_step_runs_autocast_without_its_cast_cache() -> None:
    backend = SimulatedBackend()
    phase = ["eager"]
    caches: dict[str, set[bool]] = {}

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.is_autocast_enabled("cpu"):
            caches.setdefault(phase[0], set()).add(torch.is_autocast_cache_enabled())

    capture = _simulated_capture(backend, inline=False, seen=[])

    def graphed(step_fn: Any, *args: torch.Tensor, warmup: int) -> _Replay:
        phase[0] = "graphed"
        try:
            return capture(step_fn, *args, warmup=warmup)
        finally:
            phase[0] = "eager"

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        record = measure_point(
            Point(SMALL["towers"], 2, "bfloat16"),
            CPU,
            warmup=0,
            steps=1,
            mem_steps=1,
            backend=backend,
            planner="static",
            modes=["plain", "wrapped", "wrapped_graphed"],
            capture=graphed,
            graph_warmup=2,
        )
    finally:
        handle.remove()
    assert record["failed_modes"] == {}
    assert record["wrapped_graphed"]["wrapper_in_capture"] == "side streams"
    assert caches == {"eager": {True}, "graphed": {False}}  # warm-up and captured step


def test_a_mode_that_cannot_capture_is_failed_with_its_message_not_timed() -> None:
    # The default capture is ooo_wrap.graphed_step; on a CPU it does not capture (no
    # CUDA), so both graphed modes fail with its message; eager is measured.
    record = measure_point(
        Point(SMALL["towers"], 2, "float32"),
        CPU,
        warmup=0,
        steps=1,
        mem_steps=1,
        backend=SimulatedBackend(),
        planner="static",
        modes=list(MODES),
    )
    error = (
        "NotCapturedError: no CUDA device: not captured; the warm-up steps and every call run "
        "the step eagerly (reason: no_cuda)"
    )
    assert record["failed_modes"] == {"plain_graphed": error, "wrapped_graphed": error}
    assert "plain_graphed" not in record and "wrapped_graphed" not in record
    assert record["wrapped"]["active"] and record["wrapped_overlap"]["active"]
    assert set(record["speedups"]) == {
        "wrapped",
        "wrapped_overlap",
        "wrapped_tuned",
        "wrapped_split",
    }
    assert record["wrapped_tuned"]["tuning"] is None  # this backend cannot time steps
    assert record["graphed_speedup"] is None
    table = report.modes_table([record])
    assert table.count(f"**FAILED: {error}**") == 2

    # Another capture that ran the step eagerly instead: failed with its own message.
    class Eager:
        captured = False
        reason = "not_on_cuda"
        message = "the sample args are on cpu, not a CUDA device: not captured"

    calls: list[int] = []
    record = measure_point(
        Point(SMALL["towers"], 2, "float32"),
        CPU,
        warmup=0,
        steps=1,
        mem_steps=1,
        modes=["plain", "wrapped", "plain_graphed"],
        capture=lambda step_fn, *args, **kwargs: calls.append(1) or Eager(),
    )
    assert record["failed_modes"] == {
        "plain_graphed": f"NotCapturedError: {Eager.message} (reason: not_on_cuda)"
    }
    assert "plain_graphed" not in record and calls == [1]  # not made again to be timed


def test_plain_or_wrapped_failing_still_fails_the_point(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import measure

    body = measure._Side.body

    def wrapped_breaks(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.name == "wrapped":
            raise RuntimeError("boom")
        return body(self, *args, **kwargs)

    monkeypatch.setattr(measure._Side, "body", wrapped_breaks)
    with pytest.raises(RuntimeError, match="boom"):  # raised, for the suite to file it
        measure_point(Point(SMALL["towers"], 2, "float32"), CPU, steps=1, mem_steps=1, modes=MODES)


def test_mode_selection_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.parse_args([]).modes == ["plain", "wrapped"]
    both = suite.parse_args(["--graphs", "--overlap-forward", "--tuned", "--split"])
    assert both.modes == list(MODES)
    settings = suite._settings(both)
    assert settings["modes"] == list(MODES) and settings["overlap_forward"]
    assert settings["graph_warmup"] == 3 and "replay" in settings["timing"]
    listed = suite.parse_args(["--modes", "wrapped_graphed,wrapped,plain,wrapped"])
    assert listed.modes == ["plain", "wrapped", "wrapped_graphed"]  # MODES order, no repeat
    assert not suite._settings(listed)["overlap_forward"]
    for bad, message in (
        ("plain,plain_graphed", "must include plain and wrapped"),
        ("plain,wrapped,compiled", "unknown mode compiled"),
    ):
        with pytest.raises(SystemExit):
            suite.parse_args(["--modes", bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        suite.parse_args(["--graphs", "--graph-warmup", "1"])  # graphed_step needs 2
    assert "--graph-warmup must be >= 2" in capsys.readouterr().err


BOOM = "OOOError: capturing the step in a CUDA graph failed (boom)"  # graphed_step's error


def _moded_measure(point: Point, device: torch.device, **kwargs: Any) -> dict[str, Any]:
    """measure_point's stand-in for runs with every mode: the modes asked for, by batch."""
    record = fake_record("towers", TARGET, point.batch, 1.1)
    record["modes"] = list(kwargs["modes"])
    record["failed_modes"], record["out_of_memory_modes"] = {}, []
    record["speedups"] = {"wrapped": 1.1}
    for mode in kwargs["modes"][2:]:
        record[mode] = dict(record["wrapped"], median_ms=1.0)
        record["speedups"][mode] = 2.0
    if point.batch == 32:
        record["failed_modes"]["plain_graphed"] = BOOM
        del record["plain_graphed"], record["speedups"]["plain_graphed"]
        record["out_of_memory_modes"].append("wrapped_overlap")
        del record["wrapped_overlap"], record["speedups"]["wrapped_overlap"]
    if point.batch == 64:
        record["wrapped_graphed"].update(active=False, events=["DISABLED/cpu"])
    return record


def test_the_suite_files_each_modes_outcome_under_the_point(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(suite, "measure_point", _moded_measure)
    monkeypatch.setattr(suite, "environment", lambda argv: dict(ENV))
    monkeypatch.setattr(suite.overhead, "measure", lambda repeats, calls: dict(HOST))
    flags = "--models towers --dtypes float32 --towers-widths 2048 --towers-batches 16,32,64"
    flags += " --planner static --graphs --overlap-forward --tuned --split"
    args = suite.parse_args(flags.split())
    data = suite.run_gpu(args, [], device=CPU)
    name = "towers K=8 W=2048 D=4 batch={} float32"
    assert [r["modes"] for r in data["results"]] == [list(MODES)] * 3
    assert data["errors"] == [f"{name.format(32)} [plain_graphed]: {BOOM}"]
    assert data["out_of_memory"] == [f"{name.format(32)} [wrapped_overlap]"]
    assert data["fallbacks"] == [f"{name.format(64)} [wrapped_graphed]: DISABLED/cpu"]
    err = capsys.readouterr().err
    assert (
        "wrapped_graphed 1.000 ms (2.000x)" in err
        and "FAILED: plain_graphed, wrapped_overlap" in err
    )
    text = report.render_report(data)
    assert f"Modes measured at every point: {', '.join(MODES)}" in text
    assert f"**FAILED: {BOOM}**" in text
    assert "| wrapped_overlap | - | - | - | - | out of memory on this GPU |" in text
    assert "**not wrapped: DISABLED/cpu**" in text
    assert f"- {name.format(32)} [plain_graphed]: OOOError" in text  # FAILED points


def test_a_run_of_plain_and_wrapped_has_no_modes_table(monkeypatch: pytest.MonkeyPatch) -> None:
    data, _ = _run(monkeypatch, "16")
    assert "Modes measured" not in report.render_report(data)


def test_the_time_budget_leaves_the_last_family_listed_not_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter(range(0, 1000, 10))  # each read 10 s on: a point starts at 10 s, the next at 30 s
    monkeypatch.setattr(suite.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(suite, "measure_point", _moded_measure)
    monkeypatch.setattr(suite, "environment", lambda argv: dict(ENV))
    monkeypatch.setattr(suite.overhead, "measure", lambda repeats, calls: dict(HOST))
    flags = "--models towers,fanout --dtypes float32 --towers-widths 2048 --towers-batches 16"
    flags += " --fanout-batches 128,256"
    args = suite.parse_args([*flags.split(), "--planner", "static", "--graphs", "--budget-s", "35"])
    data = suite.run_gpu(args, [], device=CPU)
    assert [r["batch"] for r in data["results"]] == [16, 128] and not data["errors"]
    assert data["skipped"] == ["fanout N=16 W=128 D=2 batch=256 float32"]
    assert data["complete"] and data["points_planned"] == 3


ENV = {
    "date_utc": "2026-12-01T07:00:00+00:00",
    "gpu": "test",
    "torch": "2.11.0",
    "ooo_wrap": "0.1.0",
    "command": "python benchmarks/suite.py",
}


def test_a_mode_out_of_memory_is_listed_as_such_not_as_a_failure() -> None:
    def warm_up_too_big(*args: Any, **kwargs: Any) -> Any:  # graphed_step lets it through
        raise torch.OutOfMemoryError("CUDA out of memory (warm-up)")

    def capture_too_big(*args: Any, **kwargs: Any) -> Any:  # graphed_step wraps it
        try:
            raise torch.OutOfMemoryError("CUDA out of memory (graph pool)")
        except torch.OutOfMemoryError as error:
            raise ooo_wrap.OOOError("capturing the step in a CUDA graph failed") from error

    def capture_breaks(*args: Any, **kwargs: Any) -> Any:
        raise ooo_wrap.OOOError("capturing the step in a CUDA graph failed (sync)")

    def measured(capture: Callable[..., Any]) -> dict[str, Any]:
        return measure_point(
            Point(SMALL["towers"], 2, "float32"),
            CPU,
            warmup=0,
            steps=1,
            mem_steps=1,
            modes=["plain", "wrapped", "plain_graphed"],
            capture=capture,
        )

    for capture in (warm_up_too_big, capture_too_big):
        record = measured(capture)
        assert record["out_of_memory_modes"] == ["plain_graphed"]
        assert record["failed_modes"] == {}
        table = report.modes_table([record])
        assert "| plain_graphed | - | - | - | - | out of memory on this GPU |" in table
    record = measured(capture_breaks)
    assert record["out_of_memory_modes"] == []
    assert record["failed_modes"] == {
        "plain_graphed": "OOOError: capturing the step in a CUDA graph failed (sync)"
    }


@pytest.mark.parametrize("name", sorted(overhead.MODELS))
def test_every_wrapped_side_of_the_overhead_benchmarks_runs_its_hooks(name: str) -> None:
    # Regression: with the default dataflow planner these one-op stages learned
    # no_parallelism on the first forward and lost every hook, so --overlap-forward and
    # --compare-with timed plain forwards and reported about 0 µs added per stage call.
    x = torch.ones(1)
    sides = overhead.overlap_sides(overhead.MODELS[name]())
    sides["other"] = overhead._wrap_static(ooo_wrap, overhead.MODELS[name]())
    for side, model in sides.items():
        if side == "plain":
            continue
        model(x)
        model(x)
        assert model.stats.stage_calls == 2 * overhead.NUM_STAGES, (side, model.stats)
    assert sides["overlap"].stats.joins > 0


def test_overhead_times_forwards_while_tuning_is_pending() -> None:
    result = overhead.measure_tuning(repeats=2, warmup=1)
    assert result["plain_us_per_forward"] > 0
    assert result["untuned_us_per_forward"] > 0 and result["tuning_us_per_forward"] > 0


# --- benchmarks/wgrad.py: the weight-gradient split's memory --------------------------------


def test_the_split_peak_memory_stays_within_its_budget_at_the_slowest() -> None:
    # A small transformer block, replayed with the weight-gradient stream at its slowest
    # (it runs nothing until a stream waits on it): the lag's byte budget keeps the peak
    # within 1 + HELD_FRACTION of plain; without the budget the same replay exceeds it.
    from benchmarks import wgrad

    result = wgrad.peak_memory(width=32, batch=2, tokens=16, heads=4)
    bound = 1 + wgrad.HELD_FRACTION
    assert bound == pytest.approx(1.10)
    assert 1.0 <= result["ratio_cpu"] <= result["ratio_worst_gpu"] <= bound, result
    assert result["ratio_unbounded_gpu"] > bound, result


def test_a_decided_model_costs_what_its_arm_pinned_costs() -> None:
    """The benchmark behind the docs' figure runs: the race keeps the arm its clock favours,
    and both wrapped sides carry the same hooks (their time is the docs' figure, measured
    by the command, not asserted here)."""
    result = overhead.measure_decided(repeats=1, calls=2)
    assert set(result) == {
        "plain_us_per_forward",
        "decided_us_per_forward",
        "pinned_us_per_forward",
        "decided_over_pinned",
    }
