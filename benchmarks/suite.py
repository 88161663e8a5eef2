"""A/B benchmark of ooo_wrap on one CUDA GPU: plain vs wrapped, interleaved in one process.

Run: ``python benchmarks/suite.py [flags]`` (``--help`` lists them). Four model families
(towers, branches, the reference transformer, the launch-bound fanout), each swept over
batch size (towers over width too), in float32 and bfloat16 autocast. Every point
measures plain and wrapped eager, and the other modes asked for (``--modes``,
``--overlap-forward``, ``--graphs``: wrapped with ``overlap_forward=True``, and the whole
step captured as a CUDA graph by ``ooo_wrap.graphed_step``, plain and wrapped), all
interleaved. For every point and mode: warm-up apart from steady state; median, p10 and
p90 of the synchronized step time (forward + backward + optimizer step, or one replay);
samples/s; peak memory of each side alone; the wrapper's stats per step, or for a graphed
side its stage calls forked onto side streams and run inline during the capture (see
``benchmarks/measure.py`` for the method). A mode that fails at a point (a step that
cannot be captured) is listed as failed with its error.
Output: a markdown report on stdout, a JSON file and a PNG plot of speedup (matplotlib,
from the optional ``bench`` extra), named with the date and the GPU; a progress line on
stderr while it runs. The JSON is rewritten after
every point, so a run stopped from outside keeps what it measured; each point also records
a cost model's estimate when one is wired in (``benchmarks/estimate.py``). The command line
and the sweep are in ``benchmarks/sweep.py``.

On a machine without a CUDA GPU it measures only the host overhead of the hooks
(``benchmarks/overhead.py``) and says that speed figures need a GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
if sys.path[0] != str(ROOT):  # benchmark this checkout, not some other installed copy
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ooo_wrap  # noqa: E402
from benchmarks import calibrate, estimate, overhead  # noqa: E402
from benchmarks.estimate import Estimator, estimate_times  # noqa: E402
from benchmarks.measure import WRAPPED_MODES, Point, measure_point  # noqa: E402
from benchmarks.report import (  # noqa: E402
    CPU_ONLY_MESSAGE,
    render_report,
    write_json,
    write_plot,
)
from benchmarks.sweep import build_points, parse_args  # noqa: E402

OPTIMIZER = "SGD(lr={lr:g}, momentum=0.9)"
COMMIT_VARIABLE = "OOO_WRAP_COMMIT"  # the commit, for a checkout copied without .git


def gpu_available() -> bool:
    """Whether this process can measure speed: a CUDA GPU is visible to PyTorch."""
    return torch.cuda.is_available()


def _git_commit() -> str | None:
    """The checkout's commit; from ``OOO_WRAP_COMMIT`` where there is no ``.git`` (a copy)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return os.environ.get(COMMIT_VARIABLE) or None
    return out.stdout.strip() or os.environ.get(COMMIT_VARIABLE) or None


def environment(argv: Sequence[str]) -> dict[str, Any]:
    """Where and how the run happened: date, versions, GPU, precision switches, command."""
    gpu = torch.cuda.get_device_name(0) if gpu_available() else None
    capability = torch.cuda.get_device_capability(0) if gpu_available() else None
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/suite.py", *argv]),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": gpu,
        "gpu_capability": list(capability) if capability else None,
        "ooo_wrap": ooo_wrap.__version__,
        "ooo_wrap_path": str(Path(ooo_wrap.__file__).parent),
        "git_commit": _git_commit(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def output_stem(env: dict[str, Any]) -> str:
    """``<date>T<hhmm>Z_<gpu>``, e.g. ``2026-11-30T0415Z_nvidia-h200``."""
    stamp = dt.datetime.fromisoformat(env["date_utc"]).strftime("%Y-%m-%dT%H%MZ")
    device = env["gpu"] or "cpu-only"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return f"{stamp}_{slug}"


class Progress:
    """One progress line on a stream: rewritten in place on a terminal, else one per point."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()

    def show(self, text: str) -> None:
        if self._tty:
            self._stream.write("\r\x1b[K" + text)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()


def new_report(args: argparse.Namespace, argv: Sequence[str], kind: str) -> dict[str, Any]:
    """An empty report: where and how, and a list for each way a point can end."""
    return {
        # 3: modes per point (settings.overlap_forward: wrapped_overlap measured); 4: a
        # graphed wrapped side records capture_stage_calls and capture_bypasses (the
        # wrapper's counters around the captured step) instead of counted bypass events;
        # a graphed side records graph_warmup_ms, and capture_ms is the capture alone.
        "schema": 4,
        "kind": kind,
        "complete": False,  # True once every point was tried and the overhead measured
        "environment": environment(argv),
        "settings": _settings(args),
        "points_planned": 0,
        "results": [],
        "skipped": [],  # not started: the time budget was spent
        "out_of_memory": [],  # too big for this GPU: a fact about the GPU, not a failure
        "errors": [],  # raised: a failed point
        "fallbacks": [],  # measured, but the wrapper was not active: not a pass
        "host_overhead": None,
    }


def run_gpu(
    args: argparse.Namespace,
    argv: Sequence[str],
    device: torch.device | None = None,
    *,
    json_path: Path | None = None,
    estimator: Estimator | None = None,
) -> dict[str, Any]:
    """Measure every point on the GPU (or ``device``); the report as a JSON-ready dict.

    With ``json_path`` the report is written after every point, so a run stopped from
    outside (a time limit) keeps what it measured; ``complete`` says whether it finished.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    points = build_points(args)
    if args.planner == "both":  # each point twice, side by side: learned plan, static plan
        points = [replace(point, planner=p) for point in points for p in ("dataflow", "static")]
    report = new_report(args, argv, "gpu")
    report["points_planned"] = len(points)

    def save() -> None:
        if json_path is not None:
            write_json(report, json_path)

    save()
    try:
        _measure_points(args, device, points, report, save, estimator)
    except KeyboardInterrupt:  # a time limit from outside: keep what was measured
        report["interrupted"] = True
        print("interrupted: the points measured so far are kept", file=sys.stderr)
        save()
        return report
    progress = Progress()
    progress.show("measuring host overhead of the hooks ...")
    report["host_overhead"] = overhead.measure(args.overhead_repeats, args.overhead_calls)
    if args.reference_gpu is not None:
        progress.show("measuring launch, fork/join and kernel floor for the ReferenceGPU ...")
        try:
            report["calibration"] = calibrate.measure(device)
        except Exception as error:  # the points are measured: say so, keep them
            report["calibration_error"] = f"{type(error).__name__}: {error}"
            print(f"error: calibration failed: {report['calibration_error']}", file=sys.stderr)
    progress.close()
    report["complete"] = True
    save()
    return report


def _measure_points(
    args: argparse.Namespace,
    device: torch.device,
    points: list[Point],
    report: dict[str, Any],
    save: Callable[[], None],
    estimator: Estimator | None,
) -> None:
    progress = Progress()
    start = time.monotonic()
    for i, point in enumerate(points, 1):
        elapsed = time.monotonic() - start
        if args.budget_s and elapsed > args.budget_s:
            report["skipped"].append(str(point))
            continue
        progress.show(f"[{i}/{len(points)} {elapsed:5.0f}s] measuring {point} ...")
        try:
            record = measure_point(
                point,
                device,
                warmup=args.warmup,
                steps=args.steps,
                mem_steps=args.mem_steps,
                streams=args.streams,
                seed=args.seed,
                lr=args.lr,
                planner=point.planner or args.planner,
                modes=args.modes,
                graph_warmup=args.graph_warmup,
            )
        except torch.cuda.OutOfMemoryError:
            # A size too big for this GPU is a fact about the GPU, not a failed run.
            report["out_of_memory"].append(str(point))
            progress.show(f"[{i}/{len(points)}] {point}: out of memory on this GPU")
            _release_memory()
            save()
            continue
        except Exception as error:  # report it with the rest rather than lose the run
            report["errors"].append(f"{point}: {type(error).__name__}: {error}")
            progress.show(f"[{i}/{len(points)}] {point}: FAILED: {type(error).__name__}: {error}")
            _release_memory()
            save()
            continue
        record["estimate"] = estimate_times(point, estimator)
        report["results"].append(record)
        _file_outcomes(point, record, report)
        save()
        progress.show(
            f"[{i}/{len(points)} {time.monotonic() - start:5.0f}s] {point}: " + _line(record)
        )
    progress.close()


def _file_outcomes(point: Point, record: dict[str, Any], report: dict[str, Any]) -> None:
    """A measured point's failed modes, modes out of memory, and wrapped modes that fell back."""
    for mode, error in (record.get("failed_modes") or {}).items():
        report["errors"].append(f"{point} [{mode}]: {error}")
    for mode in record.get("out_of_memory_modes") or []:
        report["out_of_memory"].append(f"{point} [{mode}]")
    for mode in WRAPPED_MODES:
        side = record.get(mode)
        if side is None or side.get("active", False):
            continue
        events = ", ".join(side.get("events", [])) or "no event recorded"
        where = "" if mode == "wrapped" else f" [{mode}]"
        report["fallbacks"].append(f"{point}{where}: {events}")


def _line(record: dict[str, Any]) -> str:
    """The progress line of a measured point: each mode's median, and its speedup."""
    parts = [f"plain {record['plain']['median_ms']:.3f} ms"]
    speedups = record.get("speedups") or {"wrapped": record["speedup"]}
    for mode, ratio in speedups.items():
        parts.append(f"{mode} {record[mode]['median_ms']:.3f} ms ({ratio:.3f}x)")
    failed = list(record.get("failed_modes") or {}) + list(record.get("out_of_memory_modes") or [])
    if failed:
        parts.append(f"FAILED: {', '.join(failed)}")
    return ", ".join(parts)


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_cpu_only(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """No GPU: only the host overhead of the hooks, and a plain statement of why."""
    report = new_report(args, argv, "cpu-only")
    report["note"] = CPU_ONLY_MESSAGE
    report["host_overhead"] = overhead.measure(args.overhead_repeats, args.overhead_calls)
    report["complete"] = True
    return report


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "warmup": args.warmup,
        "steps": args.steps,
        "mem_steps": args.mem_steps,
        "streams": args.streams,
        "planner": args.planner,
        "modes": list(args.modes),
        "overlap_forward": "wrapped_overlap" in args.modes,  # measured beside wrapped
        "graph_warmup": args.graph_warmup,
        "seed": args.seed,
        "optimizer": OPTIMIZER.format(lr=args.lr),
        "timing": "per step: synchronize, perf_counter, zero_grad + forward (autocast for "
        "bfloat16) + loss + backward + optimizer.step, synchronize, perf_counter; graphed "
        "modes: the batch copied into the graph's static inputs + one replay of the whole "
        "captured step (ooo_wrap.graphed_step; autocast without its cast cache), between "
        "the same synchronizes",
        "budget_s": args.budget_s,
        "overhead_repeats": args.overhead_repeats,
        "overhead_calls": args.overhead_calls,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suite; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.summarize is not None:
        report = json.loads(args.summarize.read_text(encoding="utf-8"))
        print(render_report(report))
        return 0
    if not gpu_available():
        if args.require_gpu:
            print(
                f"error: no CUDA GPU visible to PyTorch (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); --require-gpu was given",
                file=sys.stderr,
            )
            return 2
        print(CPU_ONLY_MESSAGE, file=sys.stderr)
        report = run_cpu_only(args, argv)
        json_path = args.json or args.out_dir / f"{output_stem(report['environment'])}.json"
    else:
        json_path = args.json or args.out_dir / f"{output_stem(environment(argv))}.json"
        print(f"JSON: {json_path} (rewritten after every point)", file=sys.stderr)
        report = run_gpu(args, argv, json_path=json_path, estimator=estimate.ESTIMATOR)
    print(render_report(report))
    print()
    print(f"JSON: {write_json(report, json_path)}")
    if report.get("calibration") and args.reference_gpu is not None:
        gpu = calibrate.reference_gpu(report["calibration"])
        gpu.save(args.reference_gpu)
        print(
            f"ReferenceGPU: {args.reference_gpu} ({gpu.name}: launch {gpu.launch_us:.2f} µs, "
            f"fork/join {gpu.fork_join_us:.2f} µs, kernel floor {gpu.kernel_floor_us:.2f} µs)"
        )
    if report["results"] and not args.no_plot:
        plot = write_plot(report["results"], args.plot or json_path.with_suffix(".png"))
        if plot is not None:
            print(f"plot: {plot}")
    if report.get("interrupted"):
        print("error: interrupted before the end; the report is partial", file=sys.stderr)
        return 130
    failed = len(report["errors"]) + len(report["fallbacks"])
    if failed:
        print(
            f"error: {len(report['errors'])} points failed and {len(report['fallbacks'])} "
            "fell back (the wrapper was not active); see the report",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
