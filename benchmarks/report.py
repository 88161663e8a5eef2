"""Turn benchmark records into a markdown report, a JSON file and a speedup plot.

The targets are the ones docs/tuning-and-performance.md states; they are reported against,
met or not, and never used to choose what is measured.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CPU_ONLY_MESSAGE",
    "markdown_table",
    "modes_table",
    "overhead_lines",
    "render_report",
    "targets_lines",
    "write_json",
    "write_plot",
]

Record = Mapping[str, Any]

CPU_ONLY_MESSAGE = (
    "No CUDA GPU on this machine: speed figures (step time, speedup, samples/s, peak memory) "
    "need a GPU and are not measured here. Only the host overhead of the wrapper's hooks is "
    "measured below."
)

# The project's GPU targets (steady state), as docs/tuning-and-performance.md lists them.
# Reported, never tuned for.
TOWERS_TARGET_SIZE = {"towers": 8, "width": 2048, "depth": 4}
TOWERS_TARGET_BATCH = 16
TOWERS_TARGET_SPEEDUP = 1.3
TRANSFORMER_TARGET_SPEEDUP = 0.97
MEMORY_TARGET_RATIO = 1.10

_MIB = 1024 * 1024


def _ms(side: Record) -> str:
    return f"{side['median_ms']:.3f} ({side['p10_ms']:.3f}-{side['p90_ms']:.3f})"


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / _MIB:,.1f}"


def _first(side: Record) -> str:
    first = side.get("first_steps_ms") or side.get("warmup_ms") or []
    return f"{first[0]:.1f}" if first else "n/a"


def _model_cell(record: Record) -> str:
    wrapped = record["wrapped"]
    cell = str(record["label"])
    if record.get("planner"):
        cell += f" [{record['planner']}]"
    if not wrapped.get("active", False):
        reasons = ", ".join(wrapped.get("events", [])) or "unknown reason"
        cell += f" **(not wrapped: {reasons})**"
    return cell


def _estimate_cell(record: Record) -> str:
    estimate = record.get("estimate") or {}
    plain, wrapped = estimate.get("plain_ms"), estimate.get("wrapped_ms")
    if plain is None or wrapped is None:
        return "n/a"
    return f"{plain:.3f} / {wrapped:.3f}"


def markdown_table(records: Sequence[Record]) -> str:
    """One row per record: step times, speedup, throughput, memory and wrapper stats.

    A column of cost-model estimates (labelled as such) is added when any record has one.
    """
    estimates = any(_estimate_cell(r) != "n/a" for r in records)
    header = (
        "| model | batch | dtype | plain ms median (p10-p90) | wrapped ms median (p10-p90) "
        "| speedup | samples/s plain / wrapped | peak MiB plain / wrapped | memory ratio "
        "| waits / record_streams per step | first step ms plain / wrapped |"
    )
    if estimates:
        header += " estimated ms plain / wrapped (cost model, not measured) |"
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in records:
        plain, wrapped = r["plain"], r["wrapped"]
        stats = wrapped.get("stats_per_step")
        stats_cell = f"{stats['waits']:g} / {stats['record_streams']:g}" if stats else "n/a"
        ratio = r.get("memory_ratio")
        row = (
            f"| {_model_cell(r)} | {r['batch']} | {r['dtype']} | {_ms(plain)} | {_ms(wrapped)} "
            f"| {r['speedup']:.3f}x "
            f"| {plain['samples_per_s']:,.0f} / {wrapped['samples_per_s']:,.0f} "
            f"| {_mib(plain['peak_memory_bytes'])} / {_mib(wrapped['peak_memory_bytes'])} "
            f"| {'n/a' if ratio is None else f'{ratio:.3f}x'} | {stats_cell} "
            f"| {_first(plain)} / {_first(wrapped)} |"
        )
        rows.append(row + (f" {_estimate_cell(r)} |" if estimates else ""))
    return "\n".join(rows)


_EAGER_PAIR = ("plain", "wrapped")


def _extra_modes(record: Record) -> list[str]:
    """The modes of ``record`` beyond plain and wrapped eager (measured or not)."""
    return [m for m in record.get("modes") or _EAGER_PAIR if m not in _EAGER_PAIR]


def _capture_note(side: Record) -> str:
    """Where the wrapper ran the captured step's stage calls, from its counters."""
    where = side.get("wrapper_in_capture")
    forked = side.get("capture_stage_calls")
    inline = side.get("capture_bypasses")
    if where == "side streams":
        return f"stages on side streams inside the capture ({forked} stage calls forked)"
    if where == "inline":
        return f"stages inline in the capture, not overlapped ({inline} stage calls bypassed)"
    if where == "partly inline":
        return (
            f"stages partly inline in the capture ({forked} stage calls forked, {inline} bypassed)"
        )
    if where == "no stage calls":
        return "no stage call in the capture"
    if where == "no stages":
        return "the plan has no stages to fork"
    return "capture not recorded"


def _mode_note(record: Record, mode: str) -> str:
    side = record[mode]
    notes = []
    if mode.endswith("_graphed"):
        capture, warmup = side.get("capture_ms"), side.get("graph_warmup_ms")
        note = "captured" + (f" in {capture:.0f} ms" if capture is not None else "")
        notes.append(note + (f" after {warmup:.0f} ms of warm-up" if warmup is not None else ""))
    if mode != "plain" and "active" in side and not side["active"]:
        reasons = ", ".join(side.get("events", [])) or "unknown reason"
        notes.append(f"**not wrapped: {reasons}**")
    elif mode == "wrapped_graphed":
        notes.append(_capture_note(side))
        if record.get("graphed_speedup") is not None:
            notes.append(f"speedup vs plain_graphed {record['graphed_speedup']:.3f}x")
    elif side.get("stats_per_step"):
        stats = side["stats_per_step"]
        notes.append(f"{stats['waits']:g} waits / {stats['record_streams']:g} record_streams")
        if mode == "wrapped_split":
            notes.append(f"{stats.get('split_layer_calls', 0):g} split layer calls")
    if mode == "wrapped_tuned":
        notes.append(_tuning_note(side.get("tuning"), side.get("tuning_steps")))
    return "; ".join(notes) or "-"


def _tuning_note(tuning: dict[str, Any] | None, steps: int | None) -> str:
    """The wrapper's own measured decision, beside the mode's interleaved time."""
    if tuning is None:
        return "did not tune (the backend cannot time steps)"
    if tuning["speedup"] is None:
        return f"tuning {tuning['decision']} after {steps} steps (too few timed)"
    medians = ", ".join(
        f"{name} {arm['median_ms']:.3f} ms"
        for name, arm in tuning["arms"].items()
        if arm["median_ms"] is not None
    )
    return (
        f"tuning: {tuning['decision']} kept after {steps} steps alone, median steps {medians} "
        f"({tuning['speedup']:.3f}x, measured by the wrapper)"
    )


def modes_table(records: Sequence[Record]) -> str:
    """One row per point and mode, for runs with modes beyond plain and wrapped eager.

    Every mode's step time against plain eager; a graphed wrapped side says whether the
    wrapper's stage calls forked onto side streams inside the capture or ran inline; a mode that
    failed or ran out of memory is a row saying so, with its error.
    """
    header = (
        "| model | batch | dtype | mode | ms median (p10-p90) | speedup vs plain eager "
        "| samples/s | peak MiB | note |"
    )
    rows = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in records:
        first = f"| {r['label']}" + (f" [{r['planner']}]" if r.get("planner") else "")
        where = f"{first} | {r['batch']} | {r['dtype']}"
        failed = r.get("failed_modes") or {}
        for mode in r.get("modes") or _EAGER_PAIR:
            if mode in failed:
                rows.append(f"{where} | {mode} | - | - | - | - | **FAILED: {failed[mode]}** |")
                continue
            if mode in (r.get("out_of_memory_modes") or []):
                rows.append(f"{where} | {mode} | - | - | - | - | out of memory on this GPU |")
                continue
            side = r.get(mode)
            if side is None:
                rows.append(f"{where} | {mode} | - | - | - | - | not measured |")
                continue
            ratio = 1.0 if mode == "plain" else (r.get("speedups") or {}).get(mode)
            rows.append(
                f"{where} | {mode} | {_ms(side)} "
                f"| {'n/a' if ratio is None else f'{ratio:.3f}x'} "
                f"| {side['samples_per_s']:,.0f} | {_mib(side.get('peak_memory_bytes'))} "
                f"| {_mode_note(r, mode)} |"
            )
    return "\n".join(rows)


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def targets_lines(records: Sequence[Record]) -> list[str]:
    """The three GPU targets, each with what this run measured against it."""
    lines = []
    target = [
        r
        for r in records
        if r["model"] == "towers"
        and dict(r["size"]) == TOWERS_TARGET_SIZE
        and r["batch"] == TOWERS_TARGET_BATCH
        and r["dtype"] == "float32"
    ]
    name = (
        f"towers K={TOWERS_TARGET_SIZE['towers']} W={TOWERS_TARGET_SIZE['width']} "
        f"D={TOWERS_TARGET_SIZE['depth']}, batch {TOWERS_TARGET_BATCH}, float32"
    )
    if target:
        s = target[0]["speedup"]
        lines.append(
            f"- {name}: target wrapped ≥ {TOWERS_TARGET_SPEEDUP:.2f}x plain; "
            f"measured {s:.3f}x ({_verdict(s >= TOWERS_TARGET_SPEEDUP)})"
        )
    else:
        lines.append(f"- {name}: target ≥ {TOWERS_TARGET_SPEEDUP:.2f}x; not measured in this run")
    towers = [r for r in records if r["model"] == "towers"]
    if towers:
        lo = min(towers, key=lambda r: r["speedup"])
        hi = max(towers, key=lambda r: r["speedup"])
        lines.append(
            f"- towers, whole sweep: {lo['speedup']:.3f}x ({lo['label']}, batch {lo['batch']}, "
            f"{lo['dtype']}) to {hi['speedup']:.3f}x ({hi['label']}, batch {hi['batch']}, "
            f"{hi['dtype']})"
        )
    transformer = [r for r in records if r["model"] == "transformer"]
    if transformer:
        worst = min(transformer, key=lambda r: r["speedup"])
        s = worst["speedup"]
        lines.append(
            f"- transformer: target wrapped ≥ {TRANSFORMER_TARGET_SPEEDUP:.2f}x plain at every "
            f"point; worst {s:.3f}x ({worst['label']}, batch {worst['batch']}, {worst['dtype']}) "
            f"({_verdict(s >= TRANSFORMER_TARGET_SPEEDUP)})"
        )
    else:
        lines.append(
            f"- transformer: target ≥ {TRANSFORMER_TARGET_SPEEDUP:.2f}x; not measured in this run"
        )
    with_memory = [r for r in records if r.get("memory_ratio") is not None]
    if with_memory:
        worst = max(with_memory, key=lambda r: r["memory_ratio"])
        m = worst["memory_ratio"]
        lines.append(
            f"- peak memory (allocated): target wrapped ≤ {MEMORY_TARGET_RATIO:.2f}x plain on "
            f"every model; worst {m:.3f}x ({worst['label']}, batch {worst['batch']}, "
            f"{worst['dtype']}) ({_verdict(m <= MEMORY_TARGET_RATIO)})"
        )
        reserved = [r for r in records if r.get("reserved_ratio") is not None]
        if reserved:
            worst = max(reserved, key=lambda r: r["reserved_ratio"])
            lines.append(
                f"- peak memory reserved by the allocator, for reference: worst "
                f"{worst['reserved_ratio']:.3f}x ({worst['label']}, batch {worst['batch']}, "
                f"{worst['dtype']})"
            )
    else:
        lines.append(
            f"- peak memory: target ≤ {MEMORY_TARGET_RATIO:.2f}x; not measured in this run"
        )
    return lines


def overhead_lines(overhead: Mapping[str, float]) -> list[str]:
    """The host-overhead measurement as a small markdown table."""
    return [
        "| measure | value |",
        "|---|---|",
        f"| added per stage call | {overhead['added_us_per_stage_call']:.2f} µs "
        "(target: at most 10 µs) |",
        f"| plain forward of the 24-stage model | {overhead['plain_us_per_forward']:.1f} µs |",
        f"| wrapped forward | {overhead['wrapped_us_per_forward']:.1f} µs |",
    ]


def render_report(report: Mapping[str, Any]) -> str:
    """The whole human report of a run (GPU or CPU-only) as markdown."""
    env = report["environment"]
    lines = [f"# ooo_wrap benchmark, {env['date_utc']}", ""]
    device = env.get("gpu") or "no GPU"
    lines.append(
        f"Device: {device}; torch {env['torch']} (CUDA {env.get('cuda') or 'none'}); "
        f"ooo_wrap {env['ooo_wrap']}; git {env.get('git_commit') or 'unknown'}."
    )
    lines.append(f"Command: `{env['command']}`")
    lines.append("")
    if report["kind"] == "cpu-only":
        lines += [CPU_ONLY_MESSAGE, ""]
    else:
        settings = report["settings"]
        lines.append(
            f"Steady state: median (p10-p90) of {settings['steps']} synchronized steps per side "
            f"(forward + backward + optimizer step) after {settings['warmup']} warm-up steps, "
            f"plain and wrapped interleaved; speedup = plain / wrapped step time; peak memory "
            f"of each side alone over {settings['mem_steps']} steps; "
            f"streams={settings['streams']}, seed {settings['seed']}, {settings['optimizer']}."
        )
        lines.append("")
        lines.append(markdown_table(report["results"]))
        lines.append("")
        modes = settings.get("modes") or list(_EAGER_PAIR)
        if any(_extra_modes(r) for r in report["results"]) or len(modes) > 2:
            lines.append(
                f"Modes measured at every point: {', '.join(modes)} (interleaved with plain "
                "and wrapped; graphed: the batch copied in and one replay of the captured "
                f"step, after {settings.get('graph_warmup', 3)} eager warm-up steps and the "
                "capture, which are reported apart):"
            )
            lines.append("")
            lines.append(modes_table(report["results"]))
            lines.append("")
        sources = {(r.get("estimate") or {}).get("source") for r in report["results"]} - {None}
        lines += [f"Estimated columns: {source}." for source in sorted(sources)]
        lines += [""] if sources else []
        lines.append("Targets (GPU, steady state; reported, not tuned for):")
        lines += targets_lines(report["results"])
        lines += _outcome_lines(report)
        lines.append("")
    host = report.get("host_overhead")
    if host:
        lines.append("Host overhead of the hooks (backend stream calls made free, CPU):")
        lines += overhead_lines(host)
    else:
        lines.append("Host overhead of the hooks: not measured (the run stopped before it).")
    lines += gemm_overlap_lines((report.get("calibration") or {}).get("concurrent_gemms"))
    return "\n".join(lines)


def gemm_overlap_lines(pairs: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The concurrent-GEMM measurements of the calibration, each against the cost model's
    prediction (an estimate on the H200 datasheet reference), as a markdown table."""
    if not pairs:
        return []
    lines = [
        "",
        "Two GEMMs of one shape on two streams (overlap = time on one stream / time on two; "
        "estimated: the cost model's occupancy sharing, an estimate on the H200 datasheet "
        "reference):",
        "",
        "| GEMM | dtype | GEMMs per stream | one stream ms | two streams ms | measured overlap "
        "| estimated overlap | estimated occupancy |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for pair in pairs:
        lines.append(
            f"| {pair['shape']} | {pair['dtype']} | {pair['calls_per_stream']} "
            f"| {pair['serial_ms']:.3f} | {pair['concurrent_ms']:.3f} "
            f"| {pair['measured_overlap']:.2f}x | {pair['estimated_overlap']:.2f}x "
            f"| {pair['estimated_occupancy']:.2f} |"
        )
    return lines


def _outcome_lines(report: Mapping[str, Any]) -> list[str]:
    """Every point that did not end as a wrapped measurement, each kind under its own name."""
    lines: list[str] = []
    planned = report.get("points_planned")
    if report.get("complete") is False:
        done = sum(len(report.get(key) or []) for key in _OUTCOMES) + len(report["results"])
        lines.append(
            f"INCOMPLETE: the run stopped after {done} of {planned or '?'} points "
            "(this file was written after every point)."
        )
    for key, title in _OUTCOMES.items():
        entries = report.get(key) or []
        if entries:
            lines += ["", f"{title}:", *(f"- {entry}" for entry in entries)]
    return lines


_OUTCOMES = {
    "skipped": "Not measured (time budget spent)",
    "out_of_memory": "Out of memory on this GPU (a limit of the GPU, not a failure)",
    "errors": "FAILED points",
    "fallbacks": "FELL BACK (the wrapper was not active, so not a pass)",
}


def write_json(report: Mapping[str, Any], path: Path) -> Path:
    """Write ``report`` as indented JSON, creating the folder; returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def _series(records: Iterable[Record], key: str, group: Any) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in records:
        out[group(r)].append((int(r[key] if key == "batch" else r["size"][key]), r["speedup"]))
    return {name: sorted(points) for name, points in out.items()}


def write_plot(records: Sequence[Record], path: Path) -> Path | None:
    """A PNG of speedup per model across batch sizes (and across width for towers).

    Returns the path, or ``None`` with a message on stderr if matplotlib is missing
    (it comes with the optional ``bench`` extra) or there is nothing to plot.
    """
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "plot skipped: matplotlib is not installed (pip install -e '.[bench]')",
            file=sys.stderr,
        )
        return None
    by_batch = _series(records, "batch", lambda r: f"{r['label']} {r['dtype']}")
    lines = {k: v for k, v in by_batch.items() if len(v) > 1} or by_batch
    towers = [r for r in records if r["model"] == "towers"]
    by_width = _series(
        towers,
        "width",
        lambda r: (
            f"towers K={r['size']['towers']} D={r['size']['depth']} batch {r['batch']} {r['dtype']}"
        ),
    )
    widths = {k: v for k, v in by_width.items() if len(v) > 1}
    fig, axes = plt.subplots(1, 2 if widths else 1, figsize=(13 if widths else 7, 5), squeeze=False)
    panels = [(axes[0][0], lines, "batch size")]
    if widths:
        panels.append((axes[0][1], widths, "tower width"))
    for ax, series, xlabel in panels:
        for name, points in series.items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=name)
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        ticks = sorted({x for points in series.values() for x, _ in points})
        ax.set_xticks(ticks, [str(t) for t in ticks])  # 16, 64, ... rather than 2^4, 2^6
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel("speedup (plain step time / wrapped)")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle("ooo_wrap: wrapped over plain, steady state")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
