"""The figures the docs show from a command are what that command gives today.

A count or an estimate (deterministic on the CPU) is compared with the doc's figure, read
from the doc itself; a wall-clock measurement (dated in the doc, with its machine and
command) cannot be, so the command is run at reduced repeats and must still print the
rows the doc shows. The figures of ``docs/cli.md`` are checked in ``tests/cli``, the
cross-stream table of ``docs/planner.md`` by the test that prints it
(``tests/wrapper/test_learned_wrap.py``), the tuning example by ``tests/wrapper/test_tune.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ooo_wrap
from benchmarks import calibrate, estimate, overhead, sweep
from benchmarks.measure import MODES, Point
from benchmarks.models import ModelSpec
from examples.quickstart import build_model
from ooo_wrap.testing import SimulatedBackend
from tests.support import doc_tables
from tests.support.cli_helpers import run_cli
from tests.support.doc_tables import REPO_ROOT

DOCS = REPO_ROOT / "docs"
PLANNER = DOCS / "planner.md"
TUNING = DOCS / "tuning-and-performance.md"
INTEGRATIONS = DOCS / "integrations.md"
GPU_KIT = DOCS / "gpu-kit.md"
TESTING = DOCS / "testing.md"


def text(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def figure(doc: Path, pattern: str, flags: int = 0) -> re.Match[str]:
    """The one match of ``pattern`` in ``doc``."""
    found = list(re.finditer(pattern, text(doc), flags))
    assert len(found) == 1, f"{doc.relative_to(REPO_ROOT)}: {len(found)} matches of {pattern!r}"
    return found[0]


def run_main(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *argv: str
) -> str:
    """What ``python benchmarks/overhead.py ARGV`` prints."""
    monkeypatch.setattr(sys, "argv", ["benchmarks/overhead.py", *argv])
    overhead.main()
    return capsys.readouterr().out


# --- docs/planner.md: the learned plan table of the quickstart model -------------------------


def test_the_planner_page_shows_what_plan_prints_for_the_quickstart_model() -> None:
    (block,) = re.findall(r"```pycon\n(.*?)```", text(PLANNER), re.S)
    shown = block.split(">>> print(ooo_wrap.plan(model, example_inputs=", 1)[1]
    shown = shown.split("\n", 1)[1]  # the lines after the prompt: what it printed
    command = figure(PLANNER, r"\(The second command is `python -m ooo_wrap (plan [^`]+)`").group(1)
    result = run_cli(*command.split())
    assert (result.status, result.err) == (0, "")
    # The plan as plan() prints it, then the candidate arms, which the doc quotes in words.
    plan_text, arms_text = result.out.split("\nCandidate arms: ", 1)
    estimates = dict(re.findall(r"^  (\S+) +([0-9.,]+ µs) ", arms_text, re.M))
    quoted = figure(
        PLANNER, r"candidate arms measured tuning races,\nwith these estimates: ([^;]+);"
    )
    assert quoted.group(1) == ", ".join(f"`{arm}` {us}" for arm, us in estimates.items())
    printed, doc_lines = plan_text.splitlines(), shown.splitlines()
    differences = [
        f"docs/planner.md, the example's line {number}: the doc shows {a!r}, "
        f"`python -m ooo_wrap {command}` gives {b!r}"
        for number, (a, b) in enumerate(zip(doc_lines, printed, strict=False), 1)
        if a != b
    ]
    if len(doc_lines) != len(printed):
        differences.append(f"docs/planner.md: {len(doc_lines)} lines shown, {len(printed)} printed")
    assert not differences, "\n".join(differences)


def test_the_planner_page_shows_the_plan_before_learning() -> None:
    (block,) = re.findall(r"```pycon\n(.*?)```", text(PLANNER), re.S)
    shown = block.split(">>> print(model.plan)", 1)[1].split("\n")[1]
    assert shown.endswith("(...)"), shown
    model = ooo_wrap.OOOModule(build_model(), backend=SimulatedBackend())
    assert str(model.plan).startswith(shown.removesuffix("(...)")), str(model.plan)


# --- docs/tuning-and-performance.md: host overhead ------------------------------------------


def test_the_backend_call_counts_are_what_the_benchmark_counts() -> None:
    calls = overhead.count_backend_calls()  # the command's own count: 100 forwards
    computed = {f"`{name}`": f"{calls[name]:.2f}" for name in calls}
    computed["all of them"] = computed.pop("`total`")
    computed["of the event records, events created"] = computed.pop("`new_event`")
    rows = doc_tables.table(TUNING, ("backend call", "per stage call"))
    shown = {r["backend call"]: r["per stage call"] for r in rows}
    differences = [
        line
        for name, value in computed.items()
        for line in doc_tables.differences(
            TUNING, name, {"per stage call": shown.get(name)}, {"per stage call": value}
        )
    ]
    differences += [
        f"{TUNING.name}: row {name!r}: not counted" for name in set(shown) - set(computed)
    ]
    assert not differences, "\n".join(differences)


def test_a_learned_no_parallelism_chain_makes_the_backend_calls_the_doc_says() -> None:
    shown = figure(TUNING, r"counted \*\*(\d+) backend calls per forward\*\*").group(1)
    result = overhead.measure_no_parallelism(repeats=2, calls=5, warmup=5)
    assert f"{result['backend_calls_per_forward']:.0f}" == shown


def test_the_host_overhead_command_prints_the_rows_the_doc_shows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "`python benchmarks/overhead.py` on this project's development machine" in text(TUNING)
    out = run_main(monkeypatch, capsys, "--repeats", "2", "--calls", "5")
    rows = doc_tables.table(TUNING, ("what the command prints", "value"))
    assert rows
    missing = [
        r["what the command prints"] for r in rows if f"{r['what the command prints']}:" not in out
    ]
    assert not missing, (
        f"docs/tuning-and-performance.md shows rows the command no longer prints: {missing}\n{out}"
    )
    assert "backend calls per stage call:" in out and "backend calls per forward: 0" in out


def test_the_overlap_forward_command_prints_the_rows_the_doc_shows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    command = "`python benchmarks/overhead.py --overlap-forward --repeats 60`"
    assert command in text(TUNING)
    out = run_main(monkeypatch, capsys, "--overlap-forward", "--repeats", "2", "--calls", "5")
    header = ("model (the row the command prints)", "eager joins", "overlap_forward")
    rows = doc_tables.table(TUNING, header)
    printed = out.splitlines()
    (columns,) = [line for line in printed if line.startswith("µs added per stage call")]
    assert all(name in columns for name in header[1:]), columns
    names = [re.match(r"`(\w+)`", r[header[0]]) for r in rows]
    assert all(names), rows
    printed_rows = [line.split()[0] for line in printed if line.startswith("  ")]
    assert [m.group(1) for m in names if m] == printed_rows, out


# --- docs/integrations.md: profile ranges ---------------------------------------------------


def test_the_profile_ranges_command_still_runs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "`python benchmarks/overhead.py --profile-ranges`" in text(INTEGRATIONS)
    out = run_main(monkeypatch, capsys, "--profile-ranges", "--repeats", "2", "--calls", "5")
    assert re.search(r"^added per stage call: \d+\.\d\d µs", out, re.M), out


# --- docs/gpu-kit.md: the sweep's sizes and the cost model's estimates ----------------------


def test_the_gpu_kit_sizes_step_c_as_the_default_sweep_does() -> None:
    (row,) = [
        r
        for r in doc_tables.table(
            GPU_KIT, ("step", "what it runs", "sizes", "estimated time", "limit (quick)")
        )
        if r["step"] == "c"
    ]
    sizes = re.search(
        r"(\d+) points \((\d) families, (\d) precisions\) x (\d) planners = (\d+)", row["sizes"]
    )
    largest = re.search(
        r"largest towers K=(\d+) W=(\d+) D=(\d+) \((\d+) M parameters, (\d) copies resident "
        r"with gradients and momentum: about (\d+) GB",
        row["sizes"],
    )
    assert sizes and largest, row["sizes"]
    points = sweep.build_points(sweep.parse_args([]))
    planners = 2 if sweep.parse_args([]).planner == "both" else 1
    towers = max((p.spec for p in points if p.spec.family == "towers"), key=lambda s: s.width)
    with torch.device("meta"):
        params = sum(p.numel() for p in towers.build(seed=0).parameters())
    copies = int(largest.group(5))
    computed = {
        "points": (
            len(points),
            len({p.spec.family for p in points}),
            len({p.dtype for p in points}),
        ),
        "planners": (planners, len(points) * planners),
        "largest towers": (towers.count, towers.width, towers.depth, round(params / 1e6)),
        # float32 parameters, gradients and momentum in every copy
        "GB": round(copies * 3 * 4 * params / 1e9),
    }
    shown = {
        "points": tuple(int(g) for g in sizes.group(1, 2, 3)),
        "planners": tuple(int(g) for g in sizes.group(4, 5)),
        "largest towers": tuple(int(g) for g in largest.group(1, 2, 3, 4)),
        "GB": int(largest.group(6)),
    }
    assert shown == computed, f"docs/gpu-kit.md, step c's sizes: shown {shown}, computed {computed}"


CUDA_MARK = re.compile(r"^@pytest\.mark\.cuda\b", re.M)
GPU_KIT_STEPS = ("step", "what it runs", "sizes", "estimated time", "limit (quick)")


def gpu_kit_step(step: str) -> dict[str, str]:
    (row,) = [r for r in doc_tables.table(GPU_KIT, GPU_KIT_STEPS) if r["step"] == step]
    return row


def test_the_gpu_kit_counts_the_cuda_tests_it_runs() -> None:
    shown = re.match(r"(\d+) tests \(", gpu_kit_step("a")["sizes"])
    assert shown, gpu_kit_step("a")["sizes"]
    collect = ["tests/gpu/test_cuda.py", "--collect-only", "-q", "-p", "no:cacheprovider"]
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", *collect],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    count = re.search(r"^(\d+) tests? collected", collected, re.M)
    assert count, collected
    assert shown.group(1) == count.group(1), (
        f"docs/gpu-kit.md, step a: shows {shown.group(1)} tests, pytest collects {count.group(1)}"
    )
    # Step d: every other module with a test marked cuda (a decorator line).
    modules = sorted(
        str(path.relative_to(REPO_ROOT))
        for path in (REPO_ROOT / "tests").rglob("test_*.py")
        if path.name != "test_cuda.py" and CUDA_MARK.search(path.read_text(encoding="utf-8"))
    )
    shown_d = re.search(r"(\d+) test modules", gpu_kit_step("d")["sizes"])
    assert shown_d and int(shown_d.group(1)) == len(modules), (
        f"docs/gpu-kit.md, step d: shows {shown_d and shown_d.group(1)} modules, {modules}"
    )


def test_the_gpu_kit_limits_and_sanitizer_sizes_are_the_scripts() -> None:
    script = (REPO_ROOT / "scripts" / "gpu_check.sh").read_text(encoding="utf-8")
    wants = {
        mode: dict(re.findall(r"([ABC])_WANT=(\d+)", line))
        for mode, line in re.findall(r'MODE="(\w+)" (.*)', script)
    }
    computed = {
        step: f"{wants['full'][step.upper()]} s ({wants['quick'][step.upper()]} s)"
        for step in "abc"
    }
    shown = {step: gpu_kit_step(step)["limit (quick)"] for step in "abc"}
    assert shown == computed, f"docs/gpu-kit.md, limits: shown {shown}, gpu_check.sh {computed}"
    from scripts import sanitizer_check

    sizes = gpu_kit_step("b")["sizes"]
    full, quick = len(sanitizer_check.cases()), len(sanitizer_check.cases(quick=True))
    expected = f"{full} models x 2 precisions x 2 steps (quick: {quick} models, float32)"
    assert expected in sizes, f"docs/gpu-kit.md, step b: {sizes!r}; the script: {expected!r}"


def test_the_gpu_kit_states_the_occupancy_models_gemm_overlap() -> None:
    shown = figure(
        GPU_KIT, r"as the\noccupancy model says of the float32 ones \((\d\.\d\d)x"
    ).group(1)
    computed = {
        f"{calibrate._overlap_estimate(shape, torch.float32, 200)[1]:.2f}"
        for shape in calibrate.GEMM_SHAPES
    }
    assert computed == {shown}, f"docs/gpu-kit.md: shows {shown}x, the cost model gives {computed}"


def test_the_gpu_kit_states_the_fanout_familys_estimated_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = figure(
        GPU_KIT,
        r"at width\n(\d+) and batch (\d+) to (\d+) .*?puts a step at (\d+) launched ops, "
        r"(\d+\.\d) ms, the same at both batches",
        flags=re.S,
    )
    width, low, high, ops, step_ms = found.groups()
    launched: list[int] = []
    lay_out = estimate.lay_out

    def counting(records, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("one_stream"):
            launched.append(sum(1 for r in records if r.cost_us > 0))
        return lay_out(records, **kwargs)

    monkeypatch.setattr(estimate, "lay_out", counting)
    spec = ModelSpec.fanout()
    assert spec.width == int(width)
    computed = {}
    for batch in (int(low), int(high)):
        plain_ms, _ = estimate.TraceEstimator()(Point(spec, batch, "float32", "static"))
        computed[batch] = (launched[-1], f"{plain_ms:.1f}")
    shown = {batch: (int(ops), step_ms) for batch in computed}
    assert computed == shown, (
        f"docs/gpu-kit.md, the fanout family: shown {shown}, the cost model gives {computed}"
    )


# --- docs/testing.md: the zoo ----------------------------------------------------------------


def test_the_zoo_has_the_cases_the_testing_page_counts() -> None:
    from tests.zoo.test_zoo import CASES

    tests, cases = figure(TESTING, r"runs (\d+) tests \((\d+) cases").groups()
    assert (int(tests), int(cases)) == (2 * len(CASES), len(CASES)), "docs/testing.md: the zoo"


def test_the_gpu_kit_lists_every_benchmark_mode_and_runs_them_in_step_c() -> None:
    rows = doc_tables.table(GPU_KIT, ("mode", "switch", "what one step is"))
    assert tuple(r["mode"].strip("`") for r in rows) == MODES, "docs/gpu-kit.md: the modes"
    script = (REPO_ROOT / "scripts" / "gpu_check.sh").read_text(encoding="utf-8")
    modes = re.search(r"^\s*modes=\(([^)]*)\)", script, re.M)
    assert modes, "scripts/gpu_check.sh: no modes=(...)"
    flags = modes.group(1).split()
    runs = gpu_kit_step("c")["what it runs"]
    shown = re.match(r"`benchmarks/suite\.py ([^`]*)`: every point in (\w+) modes", runs)
    assert shown, runs
    count = len(sweep.parse_args(flags).modes)
    words = {5: "five", 6: "six", 7: "seven"}
    assert (shown.group(1).split(), shown.group(2)) == (flags, words.get(count)), (
        f"docs/gpu-kit.md, step c: {runs!r}; gpu_check.sh runs {flags}: {count} modes"
    )
    sizes = gpu_kit_step("c")["sizes"]
    assert sizes.count(f" x {count} modes x ") == 1 and sizes.count(f"each {count} modes x ") == 1


# --- docs/planner.md: the two pricings, and the split's ---------------------------------------

PRICING_HEADER = ("case", "pricing", "plan", "estimated step, plan / plain", "speed-up")


def test_the_planner_page_shows_both_pricings_as_estimate_arm_gives_them() -> None:
    from torch import nn

    from benchmarks.models import Towers
    from ooo_wrap._planner.cost import H200
    from ooo_wrap._planner.dataflow import learn
    from ooo_wrap._planner.observe import observe
    from ooo_wrap._planner.simulate import estimate_arm

    rows = doc_tables.table(PLANNER, PRICING_HEADER)
    assert len(rows) == 6
    pricing = {False: "eager launches", True: "CUDA graph replay"}

    def cells(estimate: ooo_wrap.StepEstimate) -> dict[str, str]:
        return {
            "estimated step, plan / plain": (
                f"{estimate.wrapped_us:.1f} / {estimate.one_stream_us:.1f} µs"
            ),
            "speed-up": f"{estimate.speedup:.2f}x",
        }

    wrong: list[str] = []
    with torch.device("meta"):
        towers, x = Towers(8, 2048, 4), torch.randn(16, 2048)
        chain = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(8)))
    record = observe(towers, (x,))
    towers_rows = [r for r in rows if r["case"].startswith("8 towers")]
    for shown, graphed in zip(towers_rows, (False, True), strict=True):
        learned = learn(record, 4, gpu=H200, graphed=graphed)
        assert learned.estimate is not None and shown["pricing"] == pricing[graphed]
        streams = len({stage.stream for stage in learned.stages})
        plan = f"{len(learned.stages)} stages on {streams} side streams"
        assert (plan if learned.stages else "`no_parallelism`") in shown["plan"]
        wrong += doc_tables.differences(PLANNER, shown["case"], shown, cells(learned.estimate))
    assert "host-bound: 30.9 µs of kernels, 35.0 µs to launch" in str(learn(record, 4, gpu=H200)), (
        "the eager row's reason"
    )
    for batch in (8, 4096):
        with torch.device("meta"):
            chained = observe(chain, (torch.randn(batch, 1024),))
        shown_rows = [r for r in rows if f"batch {batch}, split" in r["case"]]
        for shown, graphed in zip(shown_rows, (False, True), strict=True):
            assert shown["pricing"] == pricing[graphed]
            estimate = estimate_arm(chained, {}, H200, split=True, graphed=graphed)
            wrong += doc_tables.differences(PLANNER, shown["case"], shown, cells(estimate))
    assert not wrong, "\n".join(wrong)


# --- every table of the docs is checked, or is reference text -------------------------------

# Each table of README.md and docs/*.md, by page and header: the test file that compares it
# with the command it comes from, or None for a reference table that no command prints
# (options, API, fallbacks, layers). A new table must be added here, and checked if a
# command makes it.
TABLES: dict[tuple[str, tuple[str, ...]], str | None] = {
    ("README.md", ("option", "default", "what it does")): None,
    ("torch-versions.md", ("without", "what is off")): None,
    # A dated wall-clock timing (its command and machine named above it): not comparable.
    ("weight-gradients.md", ("what", "figure")): None,
    ("README.md", ("attribute", "what it is")): None,
    ("README.md", ("function", "what it does")): None,
    ("code-layout.md", ("layer", "what it is", "may import")): None,
    ("gpu-kit.md", GPU_KIT_STEPS): "tests/project/test_docs_figures.py",
    ("gpu-kit.md", ("mode", "switch", "what one step is")): "tests/project/test_docs_figures.py",
    ("planner.md", ("model", "learned outcome")): "tests/wrapper/test_learned_wrap.py",
    ("planner.md", ("case", "pricing")): "tests/project/test_docs_figures.py",
    ("stages-and-events.md", ("condition", "behaviour", "event (`kind`/`reason`)")): None,
    ("torch-versions.md", ("API", "added", "in 2.6 / 2.11", "guard")): None,
    ("tuning-and-performance.md", ("what the command prints", "value")): (
        "tests/project/test_docs_figures.py"
    ),
    ("tuning-and-performance.md", ("backend call", "per stage call")): (
        "tests/project/test_docs_figures.py"
    ),
    ("tuning-and-performance.md", ("model (the row the command prints)", "eager joins")): (
        "tests/project/test_docs_figures.py"
    ),
}


def test_every_table_of_the_docs_is_checked_or_reference_text() -> None:
    def listed(page: str, header: list[str]) -> tuple[str, tuple[str, ...]] | None:
        """The key of TABLES that this table's header begins with."""
        return next(
            (key for key in TABLES if key[0] == page and tuple(header[: len(key[1])]) == key[1]),
            None,
        )

    every = [(doc.name, rows[0]) for doc in doc_tables.DOCS for rows in doc_tables.tables(doc)]
    unlisted = [(page, header) for page, header in every if listed(page, header) is None]
    assert not unlisted, (
        f"tables missing from TABLES (check them against their command): {unlisted}"
    )
    gone = set(TABLES) - {listed(page, header) for page, header in every}
    assert not gone, f"tables in TABLES but no longer in the docs: {gone}"
    for (page, header), checker in TABLES.items():
        if checker is not None:  # the checking test reads the table by its header
            source = (REPO_ROOT / checker).read_text(encoding="utf-8")
            assert f'"{header[1]}"' in source, (page, header, checker)


# --- the cost model's figures quoted in prose -----------------------------------------------


def test_the_docs_quote_the_cost_models_constants() -> None:
    from ooo_wrap import H200
    from ooo_wrap._planner import dataflow

    fork_join = figure(PLANNER, r"\*\*(\d+) µs per stage call\*\*").group(1)
    gain = figure(
        PLANNER,
        r"by at least (\d+) % of the region's own estimated step time\n\s*"
        r"and (\d+) µs \(`MIN_GAIN_FRACTION`",
    ).groups()
    assert (float(fork_join), float(gain[0]) / 100, float(gain[1])) == (
        H200.fork_join_us,
        dataflow.MIN_GAIN_FRACTION,
        dataflow.MIN_GAIN_US,
    ), "docs/planner.md: the fork/join cost or the gain margin"
    peaks = figure(
        TESTING,
        r"dense peaks: (\d+) TFLOP/s float32 and float64, (\d+) bfloat16/float16, (\d+) FP8\n"
        r"and int8; (\d+\.\d) TB/s; (\d+) SMs",
    ).groups()
    floors = figure(
        TESTING,
        r"plus a (\d+) µs floor per kernel.*?one after another, (\d+) µs\neach.*?each wait "
        r"costs the host (\d+) µs, a\nfork plus a join (\d+) µs",
        re.S,
    ).groups()
    peak = dict(H200.peak_flops)
    computed = (
        peak[torch.float32] / 1e12,
        peak[torch.float64] / 1e12,
        peak[torch.bfloat16] / 1e12,
        peak[torch.float16] / 1e12,
        peak[torch.float8_e4m3fn] / 1e12,
        peak[torch.int8] / 1e12,
        H200.memory_bandwidth / 1e12,
        H200.sm_count,
        H200.kernel_floor_us,
        H200.launch_us,
        H200.fork_join_us / 2,
        H200.fork_join_us,
    )
    p = [float(v) for v in peaks]
    shown = (p[0], p[0], p[1], p[1], p[2], p[2], p[3], p[4], *(float(v) for v in floors))
    assert shown == computed, f"docs/testing.md: the reference GPU: shown {shown}, H200 {computed}"
